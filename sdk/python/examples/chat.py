"""A small streaming chat over the pdmesh Python package.

    PYTHONPATH=build/python build/venv/bin/python sdk/python/examples/chat.py [ENDPOINT]
"""
import sys

import pdmesh


def main():
    endpoint = sys.argv[1] if len(sys.argv) > 1 else None
    turns = [{"role": "system", "content": "You are a helpful assistant."}]
    with pdmesh.Client(endpoint) as client:
        for line in sys.stdin:
            line = line.strip()
            if not line:
                continue
            turns.append({"role": "user", "content": line})
            stream = client.stream(messages=turns, max_tokens=128)
            try:
                for chunk in stream:
                    print(chunk.text, end="", flush=True)
            except pdmesh.PdmeshError as e:
                print(f"\nchat: {e} ({e.code})", file=sys.stderr)
                return 1
            r = stream.result
            print(f"\n[{len(r.tokens)} tokens, first after {r.ttft * 1e3:.0f} ms]", file=sys.stderr)
            turns.append({"role": "assistant", "content": r.text})
    return 0


if __name__ == "__main__":
    sys.exit(main())
