"""pdmesh: Python client of a pdmesh router (ZeroMQ + protobuf, proto/pdmesh.proto).

    import pdmesh
    with pdmesh.Client("tcp://127.0.0.1:7700") as c:
        r = c.generate("Why is the sky blue?", max_tokens=64, temperature=0)
        print(r.text)
        for chunk in c.stream(messages=[{"role": "user", "content": "Hi"}]):
            print(chunk.text, end="", flush=True)
"""
from .client import (Client, Result, Chunk, Stream, Logprob, Choice, ToolCall, seed_for_choice,
                     SEED_DEFAULT)
from .errors import (PdmeshError, PdmeshTimeout, UnreachableError, ProtocolError, ClosedError,
                     InvalidArgumentError, UnauthorizedError, OverloadedError,
                     DeadlineExceededError, CancelledError, UnavailableError, NotFoundError,
                     RouterError)

__all__ = ["Client", "Result", "Chunk", "Stream", "Logprob", "Choice", "ToolCall", "seed_for_choice",
           "SEED_DEFAULT", "PdmeshError", "PdmeshTimeout",
           "UnreachableError", "ProtocolError", "ClosedError", "InvalidArgumentError",
           "UnauthorizedError", "OverloadedError", "DeadlineExceededError", "CancelledError",
           "UnavailableError", "NotFoundError", "RouterError"]
