"""The pdmesh client over pyzmq.

Threading: a Client may be shared by threads. Every call (generate or stream) uses its own
DEALER socket, created, used and closed by the thread that runs the call, so no ZeroMQ socket
is ever touched by two threads. Stream.cancel() may be called from any thread: it sets a flag
that the thread iterating the stream (or blocked in generate) sees within 50 ms, and that
thread sends the CancelRequest. A socket monitor tells an unreachable router (no TCP
connection within connect_timeout) from one that is connected but silent (timeout).
"""
from __future__ import annotations

import itertools
import json as _json
import os
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Union

import zmq
from zmq.utils.monitor import recv_monitor_message

from . import pdmesh_pb2 as pb
from . import errors

DEFAULT_ENDPOINT = "tcp://127.0.0.1:7700"
_HDR = struct.Struct(">2sBBHH")
_VERSION = 1
_POLL_SLICE = 0.05
_ROLES = ("system", "user", "assistant", "tool")
_MAX_N = 8
_FINISH = {pb.FINISH_NONE: "none", pb.FINISH_EOS: "eos", pb.FINISH_LENGTH: "length",
           pb.FINISH_STOP: "stop"}
_MASK64 = (1 << 64) - 1
# The seed a request that names none (seed 0) samples with (common/pdm.h PDM_SEED_DEFAULT).
SEED_DEFAULT = 0x5EED


def seed_for_choice(seed: int, i: int) -> int:
    """The seed choice i of a request seeded with `seed` samples with (OpenAI's n): the C
    rule pdm_seed_for_choice (common/pdm.h, pdm_sampler_seed_for_choice), the router's and
    the decode node's: `seed` for i = 0, else splitmix64 of seed XOR (i * 0xD1B54A32D192ED03).
    `seed` is the one sampled with (SEED_DEFAULT for a request that named none)."""
    if i == 0:
        return seed
    z = ((seed ^ (i * 0xD1B54A32D192ED03)) + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def pack(msg_type, msg):
    """One pdmesh frame: 8-byte header + protobuf bytes (proto/pdmesh.proto)."""
    return _HDR.pack(b"PD", _VERSION, 0, msg_type, 0) + msg.SerializeToString()


_CLASSES = {
    pb.MSG_ACCEPTED: pb.Accepted, pb.MSG_TOKEN_CHUNK: pb.TokenChunk,
    pb.MSG_GENERATE_RESULT: pb.GenerateResult, pb.MSG_ERROR: pb.Error, pb.MSG_PONG: pb.Ping,
    pb.MSG_ADMIN_REPLY: pb.AdminReply,
}


def unpack(frame, max_frame):
    """(type, message) of a frame; ProtocolError for anything malformed or unexpected."""
    if len(frame) > max_frame:
        raise errors.ProtocolError(f"reply of {len(frame)} bytes over the {max_frame} limit")
    if len(frame) < _HDR.size:
        raise errors.ProtocolError(f"short frame ({len(frame)} bytes)")
    magic, version, _, msg_type, _ = _HDR.unpack_from(frame)
    if magic != b"PD" or version != _VERSION:
        raise errors.ProtocolError("not a pdmesh frame (bad magic or version)")
    cls = _CLASSES.get(msg_type)
    if cls is None:
        raise errors.ProtocolError(f"unexpected message type {msg_type}")
    m = cls()
    try:
        m.ParseFromString(frame[_HDR.size:])
    except Exception as e:  # DecodeError and friends
        raise errors.ProtocolError(f"malformed message of type {msg_type}: {e}") from None
    return msg_type, m


@dataclass
class Logprob:
    """A token's log-probability (logprobs=True): log_softmax of the logits after logit_bias
    and the penalties, at temperature 1, before top-k/top-p/min-p (docs/http.md). `text` is
    the token's bytes; `logprob` is None when the router had none; `top` the most likely
    tokens, most likely first (their own `top` is empty)."""
    token: int
    logprob: Optional[float]
    text: bytes
    top: List["Logprob"] = field(default_factory=list)


def _logprobs(lst) -> List[Logprob]:
    return [Logprob(token=e.token, logprob=None if e.missing else e.logprob, text=e.text,
                    top=[Logprob(token=t.token, logprob=t.logprob, text=t.text) for t in e.top])
            for e in lst]


@dataclass
class Chunk:
    index: int                       # of its first token in its choice's completion
    tokens: List[int]
    text: str
    logprobs: List[Logprob] = field(default_factory=list)  # one per token with logprobs=True
    choice: int = 0                  # n > 1: the choice these tokens belong to


@dataclass
class ToolCall:
    """A tool call found in a chat's output (tools=...): OpenAI's tool_calls entry."""
    id: str
    name: str
    arguments: str                   # the arguments as JSON text

    def args(self) -> Any:
        """The arguments parsed from their JSON text."""
        return _json.loads(self.arguments)

    def to_openai(self) -> Dict[str, Any]:
        """OpenAI's shape, for an assistant message's tool_calls in the next turn."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def _tool_calls(text: str) -> List[ToolCall]:
    if not text:
        return []
    out = []
    for c in _json.loads(text):
        fn = c.get("function", {})
        out.append(ToolCall(id=c.get("id", ""), name=fn.get("name", ""),
                            arguments=fn.get("arguments", "{}")))
    return out


@dataclass
class Choice:
    """One of the n choices of a request (n > 1), or the only one."""
    index: int
    text: str
    tokens: List[int]
    finish: str                      # "eos", "length", "stop"
    logprobs: List[Logprob] = field(default_factory=list)
    tool_calls: List[ToolCall] = field(default_factory=list)  # tools=...: the calls in text
    content: Optional[str] = None    # with tool_calls: the text outside them
    completion_tokens: int = 0


@dataclass
class Result:
    text: str
    tokens: List[int]
    finish: str                      # "eos", "length", "stop"
    usage: Dict[str, Any]
    beams: List[Dict[str, Any]] = field(default_factory=list)
    request_id: int = 0
    router_request_id: int = 0
    ttft: float = 0.0                # seconds, call start -> first token (streaming)
    total: float = 0.0               # seconds, call start -> end
    logprobs: List[Logprob] = field(default_factory=list)  # one per token with logprobs=True
    # prompt_logprobs=True: one per prompt token, log p(token | the tokens before it); the
    # first one's logprob is None (nothing predicts it)
    prompt_logprobs: List[Logprob] = field(default_factory=list)
    # every choice, in index order (n > 1; else the one); text/tokens/finish are choice 0's
    # and usage["completion_tokens"] sums them
    choices: List[Choice] = field(default_factory=list)
    tool_calls: List[ToolCall] = field(default_factory=list)  # choice 0's (tools=...)


class Stream:
    """Iterator over the Chunks of one streamed generation; `result` after the end."""

    def __init__(self, client, request, timeout):
        self._client = client
        self._request = request
        self._timeout = timeout
        self._cancel = threading.Event()
        self._done = False
        self.result: Optional[Result] = None
        self.request_id: int = request.request_id
        self.router_request_id: int = 0
        self._sock = None
        self._gen = None

    def cancel(self) -> None:
        """Cancels the generation; safe from any thread. The iterating thread raises
        CancelledError (or stops, if it already ended)."""
        self._cancel.set()

    def __iter__(self) -> Iterator[Chunk]:
        if self._gen is None:
            self._gen = self._run()
        return self._gen

    def __next__(self) -> Chunk:
        return next(iter(self))

    def close(self) -> None:
        if self._gen is not None:
            self._gen.close()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: object) -> bool:
        self.close()
        return False

    def _run(self):
        """One call over the client's routers (docs/sdk.md "Failover"): when the router is
        lost (connection dropped, never came, or it has no node yet), the request goes to
        the next router with the tokens already delivered (GenerateRequest.resume_tokens);
        the new router continues from there, so the caller sees one stream with no token
        lost or repeated. A request that delivered nothing is sent whole; one with n > 1 goes
        on per choice (_run_choices). One timeout for all attempts."""
        start = time.monotonic()
        deadline = start + self._timeout
        eps = self._client._order()
        tries = [0]  # attempts so far, every router and choice counted
        if self._request.n > 1 and len(eps) > 1:
            yield from self._run_choices(eps, tries, deadline, start)
        else:
            yield from self._completion(self._request, eps, tries, deadline, start)

    def _attempt(self, eps, tries, base, delivered, text_bytes, deadline):
        """(endpoint, request) of the next attempt: `base` with the delivered tokens as its
        resume and what is left of the call's time as its deadline."""
        ep = eps[tries[0] % len(eps)]
        tries[0] += 1
        req = pb.GenerateRequest()
        req.CopyFrom(base)
        if delivered:
            req.resume_tokens.extend(delivered)
            req.resume_text_bytes = text_bytes
        left = int((deadline - time.monotonic()) * 1000)
        req.deadline_ms = max(1, min(req.deadline_ms or left, left))
        return ep, req

    def _may_fail_over(self, ep, eps, tries, deadline):
        """After the router at ep was lost: whether the call may go on at another one."""
        self._client._mark_down(ep)
        if len(eps) == 1 or time.monotonic() >= deadline:
            return False
        if tries[0] % len(eps) == 0:
            time.sleep(0.2)  # every router failed once: a short pause
        return True

    def _completion(self, base, eps, tries, deadline, start, delivered=(), text_bytes=0,
                    choice=None):
        """One completion over the routers, resumed at the next router with what it delivered
        (starting from `delivered`, `text_bytes`); self.result is its result. choice: the
        request is that choice of a request with n > 1 going on alone; its chunks carry it."""
        delivered = list(delivered)
        while True:
            ep, req = self._attempt(eps, tries, base, delivered, text_bytes, deadline)
            gen = self._run_one(ep, req, deadline, start)
            try:
                for ch in gen:
                    if choice is not None:
                        ch.choice = choice
                    delivered.extend(ch.tokens)
                    text_bytes += len(ch.text.encode())
                    if self._request.stream:
                        yield ch
                return
            except (errors.UnreachableError, errors.UnavailableError):
                if not self._may_fail_over(ep, eps, tries, deadline):
                    raise
            finally:
                gen.close()

    def _run_choices(self, eps, tries, deadline, start):
        """OpenAI's n over several routers. The request goes whole to a router, and whole
        to the next while nothing was delivered. Once a choice delivered tokens (or ended),
        every choice that has not ended goes on at the next routers as its own request: n 1,
        the seed that choice samples with, its delivered tokens as the resume and
        GenerateRequest.resume_choice, so that the router computes it as its own choices go
        on alone; one choice after the other. The caller sees every choice's chunks
        contiguous and the result of the undisturbed call (choices, usage summed)."""
        n = self._request.n
        delivered: List[List[int]] = [[] for _ in range(n)]
        text_bytes = [0] * n
        ended: Dict[int, Any] = {}  # choice -> the GenerateResult it ended with
        first = 0.0
        while True:
            ep, req = self._attempt(eps, tries, self._request, [], 0, deadline)
            gen = self._run_one(ep, req, deadline, start, ended)
            try:
                for ch in gen:
                    if 0 <= ch.choice < n:
                        delivered[ch.choice].extend(ch.tokens)
                        text_bytes[ch.choice] += len(ch.text.encode())
                    if ch.tokens and not first:
                        first = time.monotonic()
                    if self._request.stream:
                        yield ch
                return
            except (errors.UnreachableError, errors.UnavailableError):
                if not self._may_fail_over(ep, eps, tries, deadline):
                    raise
                if ended or any(delivered):
                    break  # the choices go on one by one
            finally:
                gen.close()
        router_id = self.router_request_id
        base, choices = None, []
        for k in range(n):
            if k in ended:
                r = _result(ended[k], router_id, 0.0, 0.0)
                r.choices = [_choice(k, ended[k])]
            else:
                q = pb.GenerateRequest()
                q.CopyFrom(self._request)
                q.n = 0
                q.resume_choice = True
                if k:  # the router derives it from the seed it samples with
                    q.sampling.seed = seed_for_choice(q.sampling.seed or SEED_DEFAULT, k)
                for ch in self._completion(q, eps, tries, deadline, start, delivered[k],
                                           text_bytes[k], choice=k):
                    if ch.tokens and not first:
                        first = time.monotonic()
                    yield ch
                r = self.result
                r.choices[0].index = k
            base = base or r
            choices.append(r.choices[0])
        base.choices = choices
        base.usage["completion_tokens"] = sum(x.completion_tokens for x in choices)
        base.request_id = self.request_id
        base.ttft = (first - start) if first else 0.0
        base.total = time.monotonic() - start
        self.result = base

    def _run_one(self, endpoint, request, deadline, start, ended=None):
        """One attempt at one router; yields its Chunks and sets self.result. ended (n > 1):
        receives each choice's GenerateResult as it comes."""
        c = self._client
        sock = c._socket()
        sock.setsockopt(zmq.MAXMSGSIZE, c.max_frame)
        mon = sock.get_monitor_socket(_MONITOR_EVENTS)
        self._done = False
        try:
            sock.connect(endpoint)
            attempt_start = time.monotonic()
            connected, ever, handshaken = False, False, False
            sock.send(pack(pb.MSG_GENERATE_REQUEST, request), zmq.DONTWAIT)
            text, tokens, first = [], [], 0.0
            n_choices = max(1, request.n)
            results: Dict[int, Any] = {}
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            poller.register(mon, zmq.POLLIN)
            while True:
                if self._cancel.is_set():
                    sock.send(pack(pb.MSG_CANCEL_REQUEST,
                                   pb.CancelRequest(request_id=self.request_id)), zmq.DONTWAIT)
                    raise errors.CancelledError("cancelled", request_id=self.request_id)
                now = time.monotonic()
                if now >= deadline:
                    self._send_cancel(sock)
                    if connected:
                        raise errors.PdmeshTimeout(
                            f"no {'end of the stream' if first else 'answer'} from the router "
                            f"at {endpoint} within {self._timeout:g} s",
                            request_id=self.request_id)
                    raise errors.UnreachableError(
                        f"router at {endpoint} unreachable (not connected)",
                        request_id=self.request_id)
                if not connected and now - attempt_start >= c.connect_timeout:
                    raise errors.UnreachableError(
                        f"router at {endpoint} unreachable (no connection within "
                        f"{c.connect_timeout:g} s)", request_id=self.request_id)
                wait = min(deadline - now, _POLL_SLICE)
                events = dict(poller.poll(max(1, int(wait * 1000))))
                if mon in events:
                    while True:
                        try:
                            ev = recv_monitor_message(mon, zmq.DONTWAIT)
                        except zmq.Again:
                            break
                        refusal = _handshake_refusal(ev, endpoint)
                        if refusal:
                            raise errors.UnauthorizedError(refusal, request_id=self.request_id)
                        if ev["event"] == zmq.EVENT_CONNECTED:
                            connected = ever = True
                        elif ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                            handshaken = True
                        elif ev["event"] == zmq.EVENT_DISCONNECTED and handshaken:
                            # (before a handshake the request still waits in ZeroMQ's queue;
                            # a refused handshake may show up as a bare disconnect first)
                            raise errors.UnreachableError(
                                f"connection to the router at {endpoint} lost",
                                request_id=self.request_id)
                        elif ev["event"] == zmq.EVENT_DISCONNECTED:
                            connected = False
                if sock not in events:
                    continue
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.DONTWAIT)
                    except zmq.Again:
                        break
                    if len(frames) != 1:
                        continue  # a pdmesh message is one frame
                    msg_type, m = unpack(frames[0], c.max_frame)
                    if getattr(m, "request_id", self.request_id) != self.request_id:
                        continue
                    if msg_type == pb.MSG_ACCEPTED:
                        self.router_request_id = m.router_request_id
                    elif msg_type == pb.MSG_TOKEN_CHUNK:
                        if not first and m.tokens:
                            first = time.monotonic()
                        text.append(m.text)
                        tokens.extend(m.tokens)
                        yield Chunk(index=m.index, tokens=list(m.tokens), text=m.text,
                                    logprobs=_logprobs(m.logprobs), choice=m.choice)
                    elif msg_type == pb.MSG_ERROR:
                        raise errors.from_router(pb.ErrorCode.Name(m.code)
                                                 if m.code in pb.ErrorCode.values()
                                                 else "ERR_INTERNAL", m.message, m.request_id)
                    elif msg_type == pb.MSG_GENERATE_RESULT:
                        k = m.choice if n_choices > 1 else 0
                        if k >= n_choices or k in results:
                            continue  # malformed or repeated: the others decide
                        results[k] = m
                        if ended is not None:
                            ended[k] = m
                        if len(results) < n_choices:
                            continue  # n > 1: one result per choice
                        end = time.monotonic()
                        self.result = _result(results[0], self.router_request_id,
                                              (first - start) if first else 0.0, end - start)
                        self.result.choices = [_choice(k, results[k]) for k in range(n_choices)]
                        self.result.usage["completion_tokens"] = sum(
                            x.completion_tokens for x in self.result.choices)
                        self._done = True
                        return
        finally:
            if not self._done and ever and not self._cancel.is_set():
                # abandoned (exception, generator closed early): free the router's work
                self._send_cancel(sock)
            sock.disable_monitor()
            mon.close(0)
            sock.close(0)

    def _send_cancel(self, sock):
        try:
            sock.send(pack(pb.MSG_CANCEL_REQUEST, pb.CancelRequest(request_id=self.request_id)),
                      zmq.DONTWAIT)
        except zmq.ZMQError:
            pass


def _result(m, router_id, ttft, total):
    u = m.usage
    usage = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
             "ttft_ms": u.ttft_ms, "tpot_ms": u.tpot_ms, "total_ms": u.total_ms,
             "kv_bytes": u.kv_bytes, "prefill_method": u.prefill_method,
             "prefill_group": u.prefill_group, "decode_node": u.decode_node,
             "attempts": u.attempts, "cached_tokens": u.cached_tokens}
    beams = [{"tokens": list(b.tokens), "text": b.text, "score": b.score,
              "logprob": b.logprob, "finish": _FINISH.get(b.finish, "none")} for b in m.beams]
    return Result(text=m.text, tokens=list(m.tokens), finish=_FINISH.get(m.finish, "none"),
                  usage=usage, beams=beams, request_id=m.request_id,
                  router_request_id=router_id, ttft=ttft, total=total,
                  logprobs=_logprobs(m.logprobs), prompt_logprobs=_logprobs(m.prompt_logprobs),
                  tool_calls=_tool_calls(m.tool_calls_json))


def _choice(k, m) -> Choice:
    calls = _tool_calls(m.tool_calls_json)
    return Choice(index=k, text=m.text, tokens=list(m.tokens),
                  finish=_FINISH.get(m.finish, "none"), logprobs=_logprobs(m.logprobs),
                  tool_calls=calls, content=m.tool_content if calls else None,
                  completion_tokens=m.usage.completion_tokens)


def _tool_choice(choice) -> str:
    """OpenAI's tool_choice ("auto", "none", "required" or {"type": "function", "function":
    {"name": ...}}) as GenerateRequest.tool_choice."""
    if choice is None:
        return ""
    if isinstance(choice, str):
        return choice
    if isinstance(choice, Mapping) and isinstance(choice.get("function"), Mapping) and \
            isinstance(choice["function"].get("name"), str):
        return choice["function"]["name"]
    raise errors.InvalidArgumentError(
        'tool_choice must be "auto", "none", "required" or {"type": "function", '
        '"function": {"name": ...}}')


def _read_keys(path, secret):
    """The Z85 keys in a key file (common/curve.h format): '#' lines and blanks skipped."""
    try:
        st = os.stat(path)
        if secret and st.st_mode & 0o077:
            raise errors.InvalidArgumentError(
                "CURVE key file %s must not be accessible by group or others (chmod 600)" % path)
        keys = []
        with open(path) as f:
            for line in f:  # Z85 keys may contain '#': a 40-character first word is a key
                words = line.split()
                if words and len(words[0]) == 40 and (len(words) == 1 or words[1].startswith("#")):
                    keys.append(words[0])
                elif words and not words[0].startswith("#"):
                    raise errors.InvalidArgumentError("CURVE key file %s: bad line" % path)
    except OSError as e:
        raise errors.InvalidArgumentError("CURVE key file %s: %s" % (path, e)) from None
    if not keys or len(keys) > 2 or any(len(k) != 40 for k in keys):
        raise errors.InvalidArgumentError("CURVE key file %s: expected one or two Z85 keys" % path)
    return [k.encode() for k in keys]


def _load_curve(server_file, key_file):
    """(server public, public, secret) as Z85 bytes, or None for a plain connection."""
    if not server_file and not key_file:
        return None
    if not server_file or not key_file:
        raise errors.InvalidArgumentError("CURVE needs both the server key file and the key file")
    server = _read_keys(server_file, False)[0]
    keys = _read_keys(key_file, True)
    secret = keys[-1]
    public = zmq.curve_public(secret)
    if len(keys) == 2 and keys[0] != public:
        raise errors.InvalidArgumentError("CURVE key file %s: public and secret keys differ" % key_file)
    return server, public, secret


# A refused security handshake (a CURVE key the router's ZAP handler does not allow, or CURVE
# on one side only) is reported by the socket monitor; ZeroMQ itself would retry silently.
_MONITOR_EVENTS = (zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED |
                   zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
_MECHANISM_MISMATCH = 0x11000002  # ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH


def _handshake_refusal(ev, endpoint):
    """The reason a monitor event means "refused", or None."""
    if ev["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (f"the router at {endpoint} refused this client's CURVE key (ZAP status "
                f"{ev['value']}: the key is not in its allowlist)")
    if ev["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and ev["value"] == _MECHANISM_MISMATCH:
        return (f"security mismatch with the router at {endpoint}: one side uses CURVE, the "
                f"other does not")
    return None


class Client:
    """A client of the router's client socket (default tcp://127.0.0.1:7700, or $PDMESH_ROUTER).

    timeout: default seconds per call; connect_timeout: seconds without a TCP connection
    before a call fails with UnreachableError.
    curve_server_key_file / curve_key_file: CURVE (docs/router.md): the router's public key
    file and this client's key file (line 1 public, line 2 secret, mode 0600); default
    $PDMESH_CURVE_SERVER_KEY_FILE / $PDMESH_CURVE_KEY_FILE, else a plain connection. A key the
    router does not allow fails with UnauthorizedError."""

    def __init__(self, endpoint: "Optional[str | Sequence[str]]" = None, timeout: float = 60.0,
                 connect_timeout: float = 3.0, max_frame: int = 16 << 20,
                 curve_server_key_file: Optional[str] = None,
                 curve_key_file: Optional[str] = None) -> None:
        endpoint = endpoint or os.environ.get("PDMESH_ROUTER") or DEFAULT_ENDPOINT
        if isinstance(endpoint, str):
            endpoint = endpoint.replace(" ", ",").split(",")
        # several routers (docs/sdk.md "Failover"): calls go round robin to the routers not
        # known to be down and move to another one when theirs is lost
        self.endpoints = [e for e in endpoint if e]
        if not self.endpoints:
            raise errors.InvalidArgumentError("no router endpoint")
        self.endpoint = self.endpoints[0]
        self._down_until: Dict[str, float] = {}
        self._rr = itertools.count()
        if timeout <= 0 or connect_timeout <= 0:
            raise errors.InvalidArgumentError("timeouts must be positive")
        self.timeout = float(timeout)
        self.connect_timeout = float(connect_timeout)
        self.max_frame = int(max_frame)
        self._curve = _load_curve(
            curve_server_key_file or os.environ.get("PDMESH_CURVE_SERVER_KEY_FILE"),
            curve_key_file or os.environ.get("PDMESH_CURVE_KEY_FILE"))
        self._ctx = zmq.Context()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._closed = False

    def _socket(self):
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self._curve:
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = self._curve
        return sock

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._ctx.term()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> bool:
        self.close()
        return False

    def _next_id(self):
        with self._lock:
            return next(self._ids)

    def _order(self):
        """The routers in the order a new call tries them: round robin, the ones that failed
        in the last 2 s last."""
        with self._lock:
            k = next(self._rr) % len(self.endpoints)
            now = time.monotonic()
            eps = self.endpoints[k:] + self.endpoints[:k]
            return ([e for e in eps if self._down_until.get(e, 0) <= now] +
                    [e for e in eps if self._down_until.get(e, 0) > now])

    def _mark_down(self, endpoint):
        with self._lock:
            self._down_until[endpoint] = time.monotonic() + 2.0

    def _request(self, prompt, prompt_tokens, messages, stream, max_tokens, temperature, top_k,
                 top_p, min_p, repeat_penalty, seed, stop, deadline_ms, beams, n_best,
                 length_penalty, ignore_eos, model, timeout, early_stopping=None,
                 presence_penalty=0.0, frequency_penalty=0.0, logit_bias=None, logprobs=False,
                 top_logprobs=0, prompt_logprobs=False, prompt_only=False, json_schema=None,
                 json_object=False, n=0, tools=None, tool_choice=None):
        if self._closed:
            raise errors.ClosedError("the client is closed")
        given = sum(x is not None for x in (prompt, prompt_tokens, messages))
        if given != 1:
            raise errors.InvalidArgumentError(
                "exactly one of prompt, prompt_tokens or messages is required")
        if not 0 <= temperature <= 100:
            raise errors.InvalidArgumentError("temperature must be in [0, 100]")
        if not 0 <= top_p <= 1 or not 0 <= min_p <= 1 or top_k < 0:
            raise errors.InvalidArgumentError("top_p and min_p must be in [0, 1], top_k >= 0")
        if max_tokens < 0 or beams < 0 or beams > 64:
            raise errors.InvalidArgumentError("max_tokens >= 0 and 0 <= beams <= 64 required")
        if not -2 <= presence_penalty <= 2 or not -2 <= frequency_penalty <= 2:
            raise errors.InvalidArgumentError(
                "presence_penalty and frequency_penalty must be in [-2, 2]")
        logit_bias = dict(logit_bias or {})
        if len(logit_bias) > 300 or any(
                not isinstance(k, int) or k < 0 or k >= 2**31 or not -100 <= v <= 100
                for k, v in logit_bias.items()):
            raise errors.InvalidArgumentError(
                "logit_bias: at most 300 {token id (int >= 0): bias in [-100, 100]}")
        if not 0 <= top_logprobs <= 20:
            raise errors.InvalidArgumentError("top_logprobs must be in [0, 20]")
        if json_schema is not None and json_object:
            raise errors.InvalidArgumentError("json_schema and json_object are exclusive")
        if json_object:
            json_schema = '{"type":"object"}'
        elif json_schema is not None and not isinstance(json_schema, str):
            if not isinstance(json_schema, Mapping):
                raise errors.InvalidArgumentError(
                    "json_schema must be a JSON Schema (a dict or its JSON text)")
            json_schema = _json.dumps(json_schema)
        if prompt_only and not prompt_logprobs:
            raise errors.InvalidArgumentError("prompt_only needs prompt_logprobs")
        if not isinstance(n, int) or not 0 <= n <= _MAX_N:
            raise errors.InvalidArgumentError("n must be an int in [0, %d]" % _MAX_N)
        if n > 1 and (beams > 1 or prompt_only):
            raise errors.InvalidArgumentError("n > 1 cannot be combined with beams or "
                                              "prompt_only")
        if (tools is not None or tool_choice is not None) and messages is None:
            raise errors.InvalidArgumentError("tools need messages (a chat)")
        tools_json = ""
        if tools is not None:
            if isinstance(tools, str):
                tools_json = tools
            elif isinstance(tools, Sequence) and all(isinstance(t, Mapping) for t in tools):
                tools_json = _json.dumps(list(tools))
            else:
                raise errors.InvalidArgumentError(
                    "tools must be OpenAI's tools list (dicts) or its JSON text")
        choice = _tool_choice(tool_choice)
        stop = list(stop or [])
        if len(stop) > 16 or any(not isinstance(s, str) or not s for s in stop):
            raise errors.InvalidArgumentError("at most 16 stop strings, none empty")
        timeout = self.timeout if timeout is None else float(timeout)
        if timeout <= 0:
            raise errors.InvalidArgumentError("timeout must be positive")
        req = pb.GenerateRequest(request_id=self._next_id(), max_tokens=max_tokens, stop=stop,
                                 deadline_ms=deadline_ms or int(timeout * 1000), beams=beams,
                                 n_best=n_best, length_penalty=length_penalty, stream=stream,
                                 ignore_eos=ignore_eos, model=model or "",
                                 early_stopping=early_stopping or "",
                                 prompt_logprobs=bool(prompt_logprobs),
                                 prompt_only=bool(prompt_only), n=n if n > 1 else 0,
                                 tools_json=tools_json, tool_choice=choice)
        req.sampling.CopyFrom(pb.SamplingParams(temperature=temperature, top_k=top_k,
                                                top_p=top_p, min_p=min_p,
                                                repeat_penalty=repeat_penalty, seed=seed,
                                                presence_penalty=presence_penalty,
                                                frequency_penalty=frequency_penalty,
                                                logit_bias_ids=list(logit_bias.keys()),
                                                logit_bias_values=list(logit_bias.values()),
                                                logprobs=bool(logprobs),
                                                top_logprobs=top_logprobs if logprobs else 0,
                                                json_schema=json_schema or ""))
        if prompt is not None:
            if not isinstance(prompt, str):
                raise errors.InvalidArgumentError("prompt must be a str")
            req.prompt = prompt
        elif prompt_tokens is not None:
            toks = list(prompt_tokens)
            if not toks or any(not isinstance(t, int) or t < 0 or t >= 2**31 for t in toks):
                raise errors.InvalidArgumentError("prompt_tokens must be non-negative int32s")
            req.prompt_tokens.extend(toks)
        else:
            if not messages:
                raise errors.InvalidArgumentError("messages is empty")
            for m in messages:
                role, content = m.get("role"), m.get("content")
                calls = m.get("tool_calls")
                if content is None and calls:
                    content = ""  # an assistant turn that only called tools
                if role not in _ROLES or not isinstance(content, str):
                    raise errors.InvalidArgumentError(
                        "each message needs a role (system, user, assistant, tool) and str "
                        "content")
                if calls and role != "assistant":
                    raise errors.InvalidArgumentError("tool_calls need the role assistant")
                if calls is not None and not isinstance(calls, str):
                    calls = _json.dumps([c.to_openai() if isinstance(c, ToolCall) else c
                                         for c in calls])
                req.messages.add(role=role, content=content, tool_calls_json=calls or "",
                                 tool_call_id=m.get("tool_call_id") or "")
        if len(req.SerializeToString()) + _HDR.size > self.max_frame:
            raise errors.InvalidArgumentError("request over the frame size limit")
        return req, timeout

    def stream(self, prompt: Optional[str] = None, *,
               prompt_tokens: Optional[Sequence[int]] = None,
               messages: Optional[Sequence[Mapping[str, str]]] = None, max_tokens: int = 0,
               temperature: float = 0.0, top_k: int = 0, top_p: float = 0.0,
               min_p: float = 0.0, repeat_penalty: float = 0.0, seed: int = 0,
               stop: Optional[Iterable[str]] = None, deadline_ms: int = 0, beams: int = 0,
               n_best: int = 0, length_penalty: float = 0.0, ignore_eos: bool = False,
               model: Optional[str] = None, timeout: Optional[float] = None,
               early_stopping: Optional[str] = None, presence_penalty: float = 0.0,
               frequency_penalty: float = 0.0, logit_bias: Optional[Mapping[int, float]] = None,
               logprobs: bool = False, top_logprobs: int = 0, prompt_logprobs: bool = False,
               prompt_only: bool = False,
               json_schema: Optional[Union[str, Mapping[str, Any]]] = None,
               json_object: bool = False, n: int = 0,
               tools: Optional[Union[str, Sequence[Mapping[str, Any]]]] = None,
               tool_choice: Optional[Union[str, Mapping[str, Any]]] = None) -> "Stream":
        """A Stream: iterate it for Chunks as the router produces them; its .result holds
        the final Result once iteration ends. .cancel() works from any thread.
        presence_penalty / frequency_penalty ([-2, 2]) and logit_bias ({token id: bias in
        [-100, 100]}, at most 300) as OpenAI's; seed: the same seed, the same completion;
        logprobs=True fills Chunk.logprobs and Result.logprobs with top_logprobs (<= 20)
        alternatives per token. prompt_logprobs=True fills Result.prompt_logprobs: every
        prompt token's log-probability given the tokens before it (raw logits: no bias,
        penalty or temperature; with logprobs, top_logprobs alternatives), computed where
        the prompt is prefilled; prompt_only=True with it generates nothing (max_tokens is ignored): the
        loglikelihood of a text is then sum(lp.logprob for lp in prompt_logprobs[1:]).
        json_schema (a JSON Schema as a dict or its text) / json_object=True: structured
        output, OpenAI's response_format (docs/http.md "Structured output"): the completion is
        JSON valid against the schema (any JSON object), enforced at every step.
        n (<= 8): that many choices of the prompt, sharing its prefill and KV (docs/http.md
        "n"); choice i samples with seed pdm_sampler_seed_for_choice(seed, i); chunks carry
        their `choice`, Result.choices holds each. tools (OpenAI's tools list) and
        tool_choice ("auto", "none", "required", a function's name or OpenAI's dict) for a
        chat: the calls in the output come back parsed (Result.tool_calls, Choice.tool_calls);
        messages may carry an assistant's "tool_calls" (ToolCall objects or OpenAI's dicts)
        and tool results (role "tool", "tool_call_id")."""
        req, timeout = self._request(prompt, prompt_tokens, messages, True, max_tokens,
                                     temperature, top_k, top_p, min_p, repeat_penalty, seed,
                                     stop, deadline_ms, beams, n_best, length_penalty,
                                     ignore_eos, model, timeout, early_stopping,
                                     presence_penalty, frequency_penalty, logit_bias, logprobs,
                                     top_logprobs, prompt_logprobs, prompt_only, json_schema,
                                     json_object, n, tools, tool_choice)
        return Stream(self, req, timeout)

    def generate(self, prompt: Optional[str] = None, *,
                 prompt_tokens: Optional[Sequence[int]] = None,
                 messages: Optional[Sequence[Mapping[str, str]]] = None, max_tokens: int = 0,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 0.0,
                 min_p: float = 0.0, repeat_penalty: float = 0.0, seed: int = 0,
                 stop: Optional[Iterable[str]] = None, deadline_ms: int = 0, beams: int = 0,
                 n_best: int = 0, length_penalty: float = 0.0, ignore_eos: bool = False,
                 model: Optional[str] = None, timeout: Optional[float] = None,
                 call: Optional[List["Stream"]] = None, early_stopping: Optional[str] = None,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 logit_bias: Optional[Mapping[int, float]] = None, logprobs: bool = False,
                 top_logprobs: int = 0, prompt_logprobs: bool = False,
                 prompt_only: bool = False,
                 json_schema: Optional[Union[str, Mapping[str, Any]]] = None,
                 json_object: bool = False, n: int = 0,
                 tools: Optional[Union[str, Sequence[Mapping[str, Any]]]] = None,
                 tool_choice: Optional[Union[str, Mapping[str, Any]]] = None) -> Result:
        """Blocks until the whole completion is there; returns a Result. Raises a
        PdmeshError subclass on failure. `call`, if given, is a list that receives the
        Stream object first, so another thread can call .cancel() on it.

        Beam search (beams > 1, at most the router's limit): Result.beams holds the n_best
        hypotheses, best first ({tokens, text, score, logprob, finish}), and text/tokens are
        the best one's; early_stopping is "heuristic" (default), "early" or "never". It
        cannot be streamed, nor combined with stop strings or ignore_eos. The sampling
        arguments are stream()'s (n, tools and tool_choice included)."""
        req, timeout = self._request(prompt, prompt_tokens, messages, False, max_tokens,
                                     temperature, top_k, top_p, min_p, repeat_penalty, seed,
                                     stop, deadline_ms, beams, n_best, length_penalty,
                                     ignore_eos, model, timeout, early_stopping,
                                     presence_penalty, frequency_penalty, logit_bias, logprobs,
                                     top_logprobs, prompt_logprobs, prompt_only, json_schema,
                                     json_object, n, tools, tool_choice)
        s = Stream(self, req, timeout)
        if call is not None:
            call.append(s)
        for _ in s:
            pass
        return s.result

    def ping(self, timeout: Optional[float] = None) -> float:
        """Round trip to the router; returns seconds. Raises UnreachableError/PdmeshTimeout."""
        timeout = self.timeout if timeout is None else float(timeout)
        sock = self._socket()
        try:
            sock.connect(self.endpoint)
            nonce = int.from_bytes(os.urandom(8), "big")
            t0 = time.monotonic()
            sock.send(pack(pb.MSG_PING, pb.Ping(nonce=nonce)), zmq.DONTWAIT)
            while True:
                left = t0 + timeout - time.monotonic()
                if left <= 0 or not sock.poll(max(1, int(left * 1000))):
                    raise errors.PdmeshTimeout(f"no pong from {self.endpoint} within {timeout:g} s")
                frames = sock.recv_multipart()
                if len(frames) == 1:
                    t, m = unpack(frames[0], self.max_frame)
                    if t == pb.MSG_PONG and m.nonce == nonce:
                        return time.monotonic() - t0
        finally:
            sock.close(0)
