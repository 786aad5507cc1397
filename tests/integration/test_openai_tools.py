#!/usr/bin/env python3
"""tools / tool_choice on /v1/chat/completions through a real mesh: pdmesh-router, a prefill
group of 2 ranks (every prompt prefilled by the group: --local-threshold 0) and a decode node,
separate processes, driven by the official openai client.

The model is the default SmolLM2-135M-Instruct: its template is ChatML, which pdmesh renders
with Qwen 2.5's tool rules (docs/http.md "Tools"); SmolLM2 was not trained on that format, so
what it does under tool_choice "auto" is not meaningful (auto's parsing is tested at the unit
level, tests/unit/test_http.c and test_tokenizer.c). The enforced modes do not depend on the
model: the grammar forces the call's syntax and schema.

- tool_choice "required" (greedy, and sampled with several seeds): one tool_calls entry naming
  one of the tools, its arguments validate against that function's parameters (jsonschema),
  content null, finish_reason "tool_calls";
- a named function: that function is called, arguments validate;
- streamed (named, and "required"): OpenAI's deltas: the call's first delta carries index 0, an
  id, type "function" and the name, the arguments fragments join to valid arguments, no content,
  the last chunk's finish_reason is "tool_calls";
- "none": no tool_calls, ever; "auto": a well-formed answer (calls only with finish_reason
  "tool_calls");
- a conversation with an assistant tool call and tool results is rendered and answered;
- refusals: a function the tool_choice names that is not in tools, a parameters schema the
  grammar cannot enforce (400 naming the keyword), response_format with a forced call;
- the same enforced checks (required, named, streamed) on a second mesh whose router renders
  Llama 3.1's format (--chat-template llama3: bare {"name", "parameters"} calls, no tags);
- a third mesh with --chat-template gemma: tools are a 400 naming them (no tool format).

  python3 tests/integration/test_openai_tools.py [--bindir build/bin] [--model FILE]"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mesh import Checks, Mesh, mesh_argparser  # noqa: E402

import jsonschema  # noqa: E402
import openai  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"}},
        "required": ["city", "unit", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time.",
    "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

ASK = [{"role": "user", "content": "What is the weather in Paris today?"}]


def client(m):
    return openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % m.http_port, api_key="none",
                         max_retries=0, timeout=300)


def valid_call(name, arguments, want=None):
    """'' if (name, arguments) is a call of one of TOOLS with valid arguments, else why not."""
    if name not in SCHEMAS:
        return "unknown function %r" % name
    if want and name != want:
        return "called %r, not %r" % (name, want)
    try:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    except (ValueError, jsonschema.ValidationError) as e:
        return "arguments %r: %s" % (arguments, str(e)[:200])
    return ""


def check_required(ck, c, fmt="chatml"):
    r = c.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice="required",
                                  temperature=0, max_tokens=120)
    ch = r.choices[0]
    calls = ch.message.tool_calls or []
    print("  %s required: %r" % (fmt, [(t.function.name, t.function.arguments) for t in calls]))
    ck("%s required: one tool call" % fmt, len(calls) == 1, ch.message)
    if calls:
        t = calls[0]
        ck(fmt + " required: the call validates against its function's schema",
           valid_call(t.function.name, t.function.arguments) == "",
           valid_call(t.function.name, t.function.arguments))
        ck(fmt + " required: id call_..., type function", t.id.startswith("call_") and
           t.type == "function", t)
    ck(fmt + " required: content null, finish_reason tool_calls",
       ch.message.content is None and ch.finish_reason == "tool_calls",
       (ch.message.content, ch.finish_reason))
    x = r.usage.model_extra["pdmesh"]
    ck(fmt + " required: prefilled by the 2-rank group", x["prefill_ranks"] == 2, x)
    bad = []
    for seed in range(3):
        r = c.chat.completions.create(model="", messages=ASK, tools=TOOLS,
                                      tool_choice="required", temperature=0.8, seed=seed,
                                      max_tokens=120)
        calls = r.choices[0].message.tool_calls or []
        why = valid_call(calls[0].function.name, calls[0].function.arguments) if calls else \
            "no call (%s)" % r.choices[0].finish_reason
        if why or r.choices[0].finish_reason != "tool_calls":
            bad.append(why or r.choices[0].finish_reason)
    ck("%s required at temperature 0.8, 3 seeds: every call validates" % fmt, not bad, bad)


def check_named(ck, c, fmt="chatml"):
    for name in ("get_time", "get_weather"):
        r = c.chat.completions.create(
            model="", messages=ASK, tools=TOOLS, temperature=0, max_tokens=120,
            tool_choice={"type": "function", "function": {"name": name}})
        ch = r.choices[0]
        calls = ch.message.tool_calls or []
        print("  %s named %s: %r" % (fmt, name, [(t.function.name, t.function.arguments)
                                                for t in calls]))
        ck("%s named %s: exactly that call, valid arguments, finish tool_calls" % (fmt, name),
           len(calls) == 1 and valid_call(calls[0].function.name, calls[0].function.arguments,
                                          name) == "" and ch.finish_reason == "tool_calls",
           ch)


def stream_call(c, tool_choice):
    chunks = list(c.chat.completions.create(model="", messages=ASK, tools=TOOLS,
                                            tool_choice=tool_choice, temperature=0,
                                            max_tokens=120, stream=True))
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    deltas = [d for ch in chunks if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
    finish = [ch.choices[0].finish_reason for ch in chunks
              if ch.choices and ch.choices[0].finish_reason]
    return content, deltas, finish


def check_stream(ck, c, fmt="chatml"):
    for choice, want in (({"type": "function", "function": {"name": "get_weather"}},
                          "get_weather"), ("required", None)):
        content, deltas, finish = stream_call(c, choice)
        label = "%s streamed %s" % (fmt, want or "required")
        print("  %s: %d tool_call deltas, finish %r" % (label, len(deltas), finish))
        ck("%s: deltas arrived" % label, len(deltas) >= 1, deltas)
        if not deltas:
            continue
        first = deltas[0]
        ck("%s: first delta has index 0, id, type function, name" % label,
           first.index == 0 and first.id and first.id.startswith("call_") and
           first.type == "function" and first.function.name in SCHEMAS, first)
        ck("%s: later deltas carry only arguments of call 0" % label,
           all(d.index == 0 and not d.id and not (d.function and d.function.name)
               for d in deltas[1:]), deltas[1:])
        args = "".join(d.function.arguments or "" for d in deltas if d.function)
        ck("%s: arguments fragments join to valid arguments" % label,
           valid_call(first.function.name, args, want) == "",
           valid_call(first.function.name, args, want))
        ck("%s: no content, last finish_reason tool_calls" % label,
           content == "" and finish == ["tool_calls"], (content, finish))


def check_none_auto(ck, c):
    for stream in (False, True):
        kw = dict(model="", messages=ASK, tools=TOOLS, tool_choice="none", temperature=0,
                  max_tokens=60)
        if stream:
            _, deltas, finish = stream_call(c, "none")
            ck("none, streamed: no tool_call deltas, finish not tool_calls",
               not deltas and "tool_calls" not in finish, (deltas, finish))
        else:
            r = c.chat.completions.create(**kw)
            ch = r.choices[0]
            ck("none: no tool_calls, content text, finish not tool_calls",
               not ch.message.tool_calls and isinstance(ch.message.content, str) and
               ch.finish_reason != "tool_calls", ch)
    r = c.chat.completions.create(model="", messages=ASK, tools=TOOLS, temperature=0,
                                  max_tokens=60)
    ch = r.choices[0]
    print("  auto: %r %r %s" % (ch.message.content, ch.message.tool_calls, ch.finish_reason))
    ck("auto: a well-formed answer (calls iff finish tool_calls)",
       bool(ch.message.tool_calls) == (ch.finish_reason == "tool_calls"), ch)


def check_history(ck, c):
    msgs = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": "get_weather",
                "arguments": json.dumps({"city": "Paris", "unit": "celsius", "days": 1})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21, \"sky\": \"sun\"}"}]
    r = c.chat.completions.create(model="", messages=msgs, tools=TOOLS, temperature=0,
                                  max_tokens=40, tool_choice="none")
    ch = r.choices[0]
    ck("history with a tool call and its result: answered", isinstance(ch.message.content, str)
       and r.usage.prompt_tokens > 200, (ch, r.usage.prompt_tokens))


def check_refusals(ck, c):
    cases = [
        ("a tool_choice naming an unknown function",
         dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
         "nope"),
        ("required with a parameters schema the grammar cannot enforce",
         dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
             "type": "object", "properties": {"s": {"type": "string", "pattern": "a+"}}}}}],
              tool_choice="required"), "pattern"),
        ("a forced call with response_format",
         dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
         "response_format"),
    ]
    for label, kw, word in cases:
        try:
            c.chat.completions.create(model="", messages=ASK, max_tokens=10, **kw)
            ck("refused: %s" % label, False, "accepted")
        except openai.BadRequestError as e:
            ck("refused: %s (400 naming %s)" % (label, word), word in str(e), str(e))


def check_no_tool_format(ck, c):
    for label, kw in (("tools", dict(tools=TOOLS)),
                      ("a tool message", dict(messages=ASK + [{"role": "tool", "content": "x",
                                                               "tool_call_id": "c"}]))):
        kw.setdefault("messages", ASK)
        try:
            c.chat.completions.create(model="", max_tokens=10, **kw)
            ck("gemma: %s refused" % label, False, "accepted")
        except openai.BadRequestError as e:
            ck("gemma: %s is a 400 saying the template has no tools" % label,
               "does not support tools" in str(e), str(e))


def main():
    ap = mesh_argparser(__doc__)
    args = ap.parse_args()
    ck = Checks()
    for fmt in ("chatml", "llama3", "gemma"):
        router_args = () if fmt == "chatml" else ("--chat-template", fmt)
        m = Mesh(args.bindir, args.model, prefill_ranks=2, local_threshold=0,
                 router_args=router_args)
        try:
            m.wait_ready()
            c = client(m)
            if fmt == "gemma":
                check_no_tool_format(ck, c)
                continue
            check_required(ck, c, fmt)
            check_named(ck, c, fmt)
            check_stream(ck, c, fmt)
            if fmt == "chatml":
                check_none_auto(ck, c)
                check_history(ck, c)
                check_refusals(ck, c)
        finally:
            rc = m.stop()
            ck("%s mesh stops cleanly" % fmt, rc == 0 or rc == -9, rc)
    print("%d passed, %d failed" % (ck.passed, ck.failed))
    return 1 if ck.failed else 0


if __name__ == "__main__":
    sys.exit(main())
