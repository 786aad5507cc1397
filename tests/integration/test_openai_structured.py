#!/usr/bin/env python3
"""Structured output (response_format) through a real mesh: pdmesh-router, a prefill group of 2
ranks (kvr-e; every prompt prefilled by the group: --local-threshold 0) and two decode nodes, separate
processes, driven by the official openai client.

- client.beta.chat.completions.parse with Pydantic models (flat; nested with an enum, an
  Optional, a list and a $ref'd sub-model): the output parses and validates, finish "stop";
- json_object: the content is a JSON object; streamed, the chunks join to a JSON object;
- greedy with a constraint the model satisfies anyway: equal to the unconstrained output;
- refused schemas: 400 naming the keyword (pattern, minimum), an unknown response_format type;
- completions (not chat) with response_format;
- migration: the decode node serving a streamed, seeded (temperature 0.8) request with a schema
  is killed (SIGKILL) mid-stream; the router re-prefills prompt + delivered tokens on the other
  node, which rebuilds the matcher from the delivered tokens: the output still validates and
  equals the undisturbed run's (the draw depends on (seed, step) only).

  python3 tests/integration/test_openai_structured.py [--bindir build/bin] [--model FILE]"""
import json
import os
import signal
import sys
import time
import threading
from enum import Enum
from typing import List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mesh import Checks, Mesh, mesh_argparser  # noqa: E402

import openai  # noqa: E402
from pydantic import BaseModel, Field, ValidationError  # noqa: E402


class Person(BaseModel):
    name: str
    age: int
    city: str


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Pet(BaseModel):
    kind: str
    legs: int


class Profile(BaseModel):
    name: str
    favorite_color: Color
    nickname: Optional[str]
    hobbies: List[str] = Field(max_length=3)  # maxItems
    pet: Pet
    score: float
    active: bool


class Story(BaseModel):
    """Long enough (12 sentences) that the stream is still running when its node dies."""
    title: str
    sentences: List[str]


STORY_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "sentences": {"type": "array", "items": {"type": "string"}, "minItems": 12,
                      "maxItems": 12},
    },
    "required": ["title", "sentences"],
    "additionalProperties": False,
}


def client(m):
    return openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % m.http_port, api_key="none",
                         max_retries=0, timeout=300)


def ask(role_content):
    return [{"role": "user", "content": role_content}]


def check_parse(ck, c):
    r = c.beta.chat.completions.parse(
        model="", messages=ask("John is 31 years old and lives in Paris. Give his name, age "
                               "and city as JSON."),
        response_format=Person, temperature=0, max_tokens=200)
    ch = r.choices[0]
    print("  Person: %r" % ch.message.content)
    ck("parse(Person): validates", isinstance(ch.message.parsed, Person), ch.message.content)
    ck("parse(Person): finish stop", ch.finish_reason == "stop", ch.finish_reason)
    x = r.usage.model_extra["pdmesh"]
    ck("parse(Person): prefilled by the 2-rank group", x["prefill_ranks"] == 2, x)

    r = c.beta.chat.completions.parse(
        model="", messages=ask("Alice is a painter. Her favorite color is blue, she has no "
                               "nickname, her hobbies are painting and hiking, she has a dog "
                               "with 4 legs, her score is 9.5 and she is active. Give her "
                               "profile as JSON."),
        response_format=Profile, temperature=0, max_tokens=400)
    ch = r.choices[0]
    print("  Profile: %r" % ch.message.content)
    ck("parse(Profile: enum, Optional, list, nested $ref model): validates",
       isinstance(ch.message.parsed, Profile), ch.message.content)

    # sampled (temperature 0.7, several seeds): every completed output validates (a 135M model
    # may also wander inside a string until max_tokens: such a cut output is a valid prefix)
    bad, done = [], 0
    for seed in range(4):
        try:
            r = c.beta.chat.completions.parse(
                model="", messages=ask("Invent a person: name, age and city."),
                response_format=Person, temperature=0.7, seed=seed, max_tokens=300)
        except openai.LengthFinishReasonError:
            continue
        done += 1
        if not isinstance(r.choices[0].message.parsed, Person):
            bad.append(r.choices[0].message.content)
    ck("parse(Person) at temperature 0.7, 4 seeds: %d completed, every one validates" % done,
       done >= 1 and not bad, bad)


def check_json_object(ck, c):
    r = c.chat.completions.create(model="", messages=ask("List three fruits with their colors."),
                                  response_format={"type": "json_object"}, temperature=0,
                                  max_tokens=150)
    text = r.choices[0].message.content
    ok = False
    try:
        ok = isinstance(json.loads(text), dict)
    except ValueError:
        pass
    print("  json_object: %r (%s)" % (text[:200], r.choices[0].finish_reason))
    # a 135M model may run to max_tokens inside the object; complete answers must parse
    ck("json_object: a JSON object (or cut by max_tokens)", ok or r.choices[0].finish_reason ==
       "length", text)
    ck("json_object: starts as an object", text.lstrip().startswith("{"), text)

    chunks = c.chat.completions.create(model="", messages=ask("Give a JSON object with a name."),
                                       response_format={"type": "json_object"}, temperature=0,
                                       max_tokens=100, stream=True)
    parts, finish = [], None
    for ch in chunks:
        if ch.choices:
            parts.append(ch.choices[0].delta.content or "")
            finish = ch.choices[0].finish_reason or finish
    text = "".join(parts)
    ok = False
    try:
        ok = isinstance(json.loads(text), dict)
    except ValueError:
        pass
    ck("json_object streamed: the chunks join to a JSON object", ok or finish == "length", text)

    r = c.completions.create(model="", prompt="A JSON object describing a cat:",
                             extra_body={"response_format": {"type": "json_object"}},
                             temperature=0, max_tokens=80)
    t = r.choices[0].text
    ck("completions + json_object: starts as an object", t.lstrip().startswith("{"), t)


def check_greedy_equal(ck, c):
    """A constraint the model follows anyway changes nothing (greedy)."""
    msg = ask('Reply with only this JSON object: {"name": "Bob", "age": 3}')
    free = c.chat.completions.create(model="", messages=msg, temperature=0, max_tokens=60)
    text = free.choices[0].message.content
    try:
        is_obj = isinstance(json.loads(text), dict)
    except ValueError:
        is_obj = False
    ck("greedy unconstrained output is a JSON object (precondition)", is_obj, text)
    for rf in ({"type": "json_object"},
               {"type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": {
                   "type": "object", "properties": {"name": {"type": "string"},
                                                    "age": {"type": "integer"}},
                   "required": ["name", "age"], "additionalProperties": False}}}):
        r = c.chat.completions.create(model="", messages=msg, temperature=0, max_tokens=60,
                                      response_format=rf)
        ck("greedy with %s == unconstrained" % rf["type"], r.choices[0].message.content == text,
           "%r vs %r" % (r.choices[0].message.content, text))


def check_refusals(ck, c):
    cases = [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "string", "pattern": "^a+$"}}}, "'pattern'"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"n": {"type": "integer", "minimum": 3}}}}},
         "'minimum'"),
        ({"type": "xml"}, "not supported"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
    ]
    for rf, needle in cases:
        try:
            c.chat.completions.create(model="", messages=ask("hi"), response_format=rf,
                                      max_tokens=5)
            ck("refused: %s" % needle, False, "accepted")
        except openai.BadRequestError as e:
            ck("refused with 400 naming %s" % needle, needle in str(e), str(e))


def check_migration(ck, m, c):
    rf = {"type": "json_schema", "json_schema": {"name": "story", "strict": True,
                                                 "schema": STORY_SCHEMA}}
    msg = ask("Write a story about a dragon who learns to cook, in 12 sentences.")
    kw = dict(model="", messages=msg, response_format=rf, temperature=0.8, seed=77,
              max_tokens=1000)
    ref = c.chat.completions.create(**kw)
    ref_text = ref.choices[0].message.content
    try:
        Story.model_validate_json(ref_text)
        ref_ok = True
    except ValidationError:
        ref_ok = False
    ck("undisturbed seeded run: validates (%d tokens, finish %s)" %
       (ref.usage.completion_tokens, ref.choices[0].finish_reason), ref_ok, ref_text[-300:])
    served_by = ref.usage.model_extra["pdmesh"]["decode_node"]

    before = m.log("router").count("attempt 1 ->")
    parts, finish, usage, first_at = [], [None], [None], [None]

    def run():
        s = c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
        for ch in s:
            if ch.choices:
                if first_at[0] is None:
                    first_at[0] = time.time()
                parts.append(ch.choices[0].delta.content or "")
                finish[0] = ch.choices[0].finish_reason or finish[0]
            if ch.usage:
                usage[0] = ch.usage

    th = threading.Thread(target=run)
    th.start()
    victim = None
    end = time.time() + 60
    while time.time() < end and victim is None:
        lines = [ln for ln in m.log("router").splitlines() if "attempt 1 ->" in ln]
        if len(lines) > before:
            victim = lines[before].split("-> ")[1].split(" via")[0]
        time.sleep(0.05)
    # mid-stream: some tokens delivered, many to come
    while time.time() < end and (first_at[0] is None or len(parts) < 40):
        time.sleep(0.02)
    delivered = len(parts)
    if victim in m.procs:
        m.procs[victim][0].send_signal(signal.SIGKILL)
    th.join(300)
    text = "".join(parts)
    x = usage[0].model_extra["pdmesh"] if usage[0] else {}
    print("  migration: killed %s after %d chunks; served by %s, %s attempts, %d chars" %
          (victim, delivered, x.get("decode_node"), x.get("attempts"), len(text)))
    ck("migration: the request moved to the other decode node",
       x.get("attempts", 0) >= 2 and x.get("decode_node") not in (None, victim), x)
    try:
        Story.model_validate_json(text)
        ok = True
    except ValidationError as e:
        ok = str(e)
    ck("migration mid-stream with a schema: the joined output validates", ok is True,
       "%s: %r" % (ok, text[-300:]))
    ck("migration: equal to the undisturbed seeded run (served by %s)" % served_by,
       text == ref_text, "%r vs %r" % (text[-200:], ref_text[-200:]))


def main():
    ap = mesh_argparser(__doc__)
    args = ap.parse_args()
    ck = Checks()
    os.environ.setdefault("PDMESH_LOG", "info")  # the router logs each dispatch (the victim)
    # kvr-e: the group's prompt KV is the same float32 numbers as a single process's (the
    # migrated request's local prefill), so a seeded continuation can be compared exactly
    m = Mesh(args.bindir, args.model, prefill_ranks=2, local_threshold=0,
             router_args=("--method", "kvr-e"))
    # a second decode node: where a request goes when the first one dies
    m._start("decode-1", [os.path.join(args.bindir, "pdmesh-decode"), "--model", args.model,
                          "--threads", "1", "--router", m.node_ep, "--node-id", "decode-1"])
    try:
        m.wait_ready()
        end = time.time() + 60
        while time.time() < end and m.metric("pdmesh_nodes", 'role_state="decode_alive"') < 2:
            time.sleep(0.2)
        c = client(m)
        check_parse(ck, c)
        check_json_object(ck, c)
        check_greedy_equal(ck, c)
        check_refusals(ck, c)
        check_migration(ck, m, c)
    finally:
        rc = m.stop()
        ck("mesh stops cleanly", rc == 0 or rc == -9, rc)
    print("%d passed, %d failed" % (ck.passed, ck.failed))
    return 1 if ck.failed else 0


if __name__ == "__main__":
    sys.exit(main())
