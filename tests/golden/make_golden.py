#!/usr/bin/env python3
"""Produce pdmesh's reference data (tests/golden/golden.json) with llama.cpp.

pdmesh's tokenizer and engine must match llama.cpp exactly.  This script runs
llama.cpp through the `llama-cpp-python` bindings and records:

  * tokenize: token ids for a broad set of tricky strings (scripts, emoji,
    code, whitespace, digits, special-token text with and without special
    parsing, ...);
  * generate: for a handful of prompts, the prompt's token ids, the top-20
    logits at the last prompt position and a greedy continuation of up to
    64 tokens, decoded by hand (argmax over the raw logits, lowest id on exact
    ties), never with llama.cpp's sampler.

Usage:
    python make_golden.py --model PATH --out tests/golden/golden.json [--threads 2]

The output is deterministic: same model + same llama-cpp-python version +
same machine gives a byte-identical file.  `--dump-logits FILE.npz` also
writes every logits vector the greedy loops saw, for comparing runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np

import llama_cpp
from llama_cpp import Llama
from llamaref import sha256_file  # noqa: E402

# ---------------------------------------------------------------------------
# Fixed run configuration.  Changing any of these changes the reference data.
# ---------------------------------------------------------------------------
N_CTX = 4096
N_BATCH = 512  # prompts longer than this are evaluated in 512-token chunks
SEED = 1234  # unused by the manual greedy loop, fixed anyway
N_PREDICT = 64
TOP_K_LOGITS = 20
LONG_PROMPT_MIN_TOKENS = 1500

# ---------------------------------------------------------------------------
# Tokenizer cases: (text, special).  Strings that contain special-token text
# are listed in SPECIAL_TEXT_CASES and recorded with special=False and True.
# ---------------------------------------------------------------------------
TOKENIZE_TEXTS = [
    # Plain ASCII
    "Hello",
    "Hello world",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "HELLO WORLD in CAPS and MiXeD cAsE",
    "A sentence. Another sentence! A question? Yes.",
    # Accents and Latin-script diacritics
    "Café au lait, déjà vu, naïve résumé, crème brûlée.",
    "El niño juega mañana con el señor Muñoz en España.",
    "Über Grüße: Straße, Fußball, Mädchen, schön.",
    "Ça va ? Où est l'hôtel ? À bientôt !",
    # Greek and Cyrillic
    "Γειά σου Κόσμε! Η γλώσσα μου έδωσαν ελληνική.",
    "Привет, мир! Как дела?",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    # CJK, kana, Korean
    "你好，世界！今天天气很好。",
    "我爱北京天安门",
    "日本語のテキストです。東京は大きい都市です。",
    "ひらがな カタカナ ｶﾀｶﾅ",
    "안녕하세요, 세계! 한국어 텍스트입니다.",
    # Emoji: simple, skin tone, ZWJ sequences, flags, variation selectors
    "I love pizza 🍕🍕!",
    "👍🏽 thumbs up with a skin tone",
    "Family: 👨‍👩‍👧‍👦 and a technologist 🧑‍💻",
    "Flags: 🇫🇷🇯🇵🇺🇸🇧🇷",
    "❤️ 🏳️‍🌈 ☀️ ✔️",
    # Code
    '#include <stdio.h>\n\nint main(void) {\n    printf("Hello, world!\\n");\n    return 0;\n}\n',
    'def add(a, b):\n    """Return the sum."""\n    if a > b:\n        return a + b\n\treturn b + a\n',
    '{"name": "pdmesh", "version": [1, 2, 3], "ok": true, "nested": {"k": null}}',
    "if (a && b || !c) { x <<= 2; y >>= 1; z = x != y ? -1 : 0; }",
    "for i in range(10): print(i ** 2, end=', ')",
    # Whitespace runs
    "a  b   c    d     e",
    "\ttab\tseparated\t\tvalues",
    "line1\nline2\n\n\nline5",
    "windows\r\nline endings\r\n",
    "   ",
    "\n",
    "\n\n",
    " \t \n ",
    "    indented by four",
    "trailing spaces   ",
    "  leading and trailing  ",
    # Digits
    "1",
    "12",
    "123",
    "1234",
    "12345678901234567890",
    "3.14159",
    "1,000,000",
    "In 2024, 37% of 1500 people paid $19.99 each.",
    "0x1F 0b1010 1e-9 -42 +7",
    # Contractions
    "don't",
    "I'LL do it, you'll see",
    "they're we've she'd it's I'm",
    "Don't DON'T don't 'quoted'",
    # Punctuation runs
    "!!!???...---***",
    "Wait... what?!?! (really) [yes] {no} <maybe>",
    "\"double\" 'single' `backtick` «guillemets» “curly”",
    "==========",
    "@#$%^&*()_+-=~|\\/",
    # URLs and e-mail
    "https://www.example.com/path/to/page?query=1&lang=en#section",
    "Email john.doe+test@example.org or visit http://localhost:8080/",
    # Degenerate inputs
    "",
    " ",
    # Tricky Unicode (valid UTF-8): combining marks, RTL, invisible chars
    "e\u0301 vs \u00e9; n\u0303 vs \u00f1",
    "Z\u0324\u0354\u0367\u0311\u0313a\u0308\u0356\u032d\u0308\u0307l\u036e\u0312\u036bo\u0328\u032f\u0313",
    "שלום עולם",
    "مرحبا بالعالم",
    "The word שלום means peace.",
    "zero\u200bwidth\u200cnon\u200djoiner",
    "\ufeffBOM at the start",
    "non\u00a0breaking\u00a0space",
    "नमस्ते दुनिया",
    "สวัสดีชาวโลก",
    "ＡＢＣ１２３ full width",
    "∀x∈ℝ: x²≥0, ∑∫√∞ ≠ ≤",
    "ﬁnance ﬂoor (ligatures)",
]

SPECIAL_TEXT_CASES = [
    "<|im_start|>user\nhi<|im_end|>",
    "<|endoftext|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "text before<|endoftext|>text after",
    "<|im_start|><|im_end|>",
]

# ---------------------------------------------------------------------------
# Long prompt: a deterministic multi-paragraph essay followed by a question.
# ---------------------------------------------------------------------------
LONG_ESSAY = """\
A Short History of Keeping Time

For most of human history, the passage of time was read from the sky. Farmers watched the sun climb and fall, sailors counted the stars that rose above the horizon, and priests in many ancient cultures kept careful records of the moon's phases so that festivals would fall on the proper days. The day itself was the first unit of time, followed by the lunar month and the solar year. None of these units fit neatly inside the others, and the long struggle to reconcile them produced calendars of remarkable ingenuity, from the Egyptian civil year of 365 days to the Babylonian system of intercalary months.

The first instruments for dividing the day were shadow clocks. An upright stick, called a gnomon, casts a shadow whose length and direction change as the sun moves. Egyptian builders carved shadow clocks in stone more than three thousand years ago, and Greek and Roman engineers refined them into elaborate sundials that accounted for the latitude of the city where they stood. A sundial has an obvious weakness: it is useless at night and on cloudy days. It also divides the daylight into hours that grow longer in summer and shorter in winter, which ancient people accepted as perfectly natural.

Water clocks solved some of these problems. In the simplest design, water drips from a small hole in the bottom of a vessel, and marks on the inside wall show how much time has passed as the level falls. Athenian courts used such clocks, known as clepsydrae, to limit the length of speeches. Chinese and Islamic engineers later built enormous water-driven machines that rang bells, moved puppets and turned models of the heavens. The astronomical clock tower built by Su Song in the eleventh century was driven by a water wheel and regulated by a clever escapement that released the wheel one bucket at a time.

Mechanical clocks appeared in European monasteries and town squares toward the end of the thirteenth century. Their heart was the verge escapement, a device that lets a falling weight turn the gears only in small, regular steps. These early clocks were not very accurate; losing or gaining a quarter of an hour each day was common, and many of them had only an hour hand. Still, they changed daily life. Church bells announced equal hours instead of the old canonical hours of prayer, merchants began to schedule their meetings by the clock, and the idea of time as something that could be measured, sold and wasted slowly took hold.

The pendulum brought the first great leap in precision. Galileo noticed that a swinging lamp seemed to take the same time for each swing regardless of how wide the swing was, and in 1656 the Dutch scientist Christiaan Huygens built the first pendulum clock. Its error fell from minutes to seconds per day. Huygens also developed the balance spring, which made accurate pocket watches possible. Within a few decades, clockmakers in London, Paris and Geneva were competing to build ever finer instruments, and the minute hand became a standard feature.

Precision on land was not enough for an age of ocean voyages. A navigator can find latitude by measuring the height of the sun at noon, but longitude requires knowing the time at a reference place, such as the port of departure, at the same instant as local noon. Every four minutes of error in the clock means one degree of error in longitude, and a degree near the equator is about one hundred and eleven kilometres. After several terrible shipwrecks, the British Parliament passed the Longitude Act of 1714, offering a large prize for a practical method. The prize was eventually earned by John Harrison, a self-taught carpenter from Yorkshire, whose marine chronometer H4 lost only a few seconds on a voyage to Jamaica in 1761. His work made it possible to chart coastlines accurately and to cross oceans with confidence.

The railways created a different problem. Each town kept its own local time, set by the sun, so noon in Bristol came about ten minutes later than noon in London. That difference hardly mattered to a traveller on horseback, but it made railway timetables confusing and even dangerous. British railway companies adopted Greenwich time in the 1840s, and in 1883 the railways of the United States and Canada introduced standard time zones. A year later, the International Meridian Conference in Washington chose Greenwich as the prime meridian for the whole world, laying the foundation for the system of time zones that we still use.

In the twentieth century, quartz and atoms replaced gears and pendulums. A quartz crystal vibrates at a very stable frequency when an electric field is applied to it, and the first quartz clocks of the late 1920s were already more accurate than the best mechanical regulators. By the 1970s, cheap quartz watches had nearly destroyed the traditional Swiss watch industry, which survived by turning mechanical watches into luxury objects. Atomic clocks went further still. In 1967 the second was redefined as the duration of 9,192,631,770 periods of the radiation emitted by caesium-133 atoms during a particular transition, and today the best optical clocks would neither gain nor lose a second over the age of the universe.

Such accuracy is not merely a scientific curiosity. Satellite navigation systems such as GPS work by comparing the arrival times of signals from several satellites, and an error of one microsecond would shift a computed position by about three hundred metres. The clocks on board must even be corrected for the effects of relativity, because they run slightly faster in weaker gravity and slightly slower because of their orbital speed. Financial exchanges stamp trades with microsecond precision, power grids synchronise their generators, and telecommunications networks depend on shared time to pass data between continents.

Yet the Earth does not keep perfect time. Its rotation slows gradually because of tidal friction, and it speeds up or slows down unpredictably by a few milliseconds as the oceans, atmosphere and molten core shift. To keep civil time aligned with the sun, timekeepers have inserted leap seconds into Coordinated Universal Time since 1972. Leap seconds cause real headaches for computer systems, which often assume that every minute has exactly sixty seconds, and several well-known software failures have been traced to them. In 2022, the General Conference on Weights and Measures voted to stop adding leap seconds by 2035, accepting that civil time will slowly drift away from the sun.

The calendar needed its own repairs. The Julian calendar, introduced by Julius Caesar in 46 BC, assumed that the year lasts exactly 365.25 days, which is about eleven minutes too long. Over the centuries the error accumulated, and by the sixteenth century the spring equinox had drifted roughly ten days away from its traditional date of 21 March, upsetting the calculation of Easter. In 1582 Pope Gregory XIII issued a reform: ten days were dropped from the calendar, so that Thursday 4 October was followed directly by Friday 15 October, and century years would be leap years only when divisible by 400. Catholic countries adopted the change at once, but Britain and its colonies waited until 1752, and Russia until 1918, which is why the October Revolution is remembered in November.

Personal timekeeping also moved from the pocket to the wrist. For most of the nineteenth century, wristwatches were considered jewellery for women, while gentlemen carried pocket watches on chains. Soldiers changed that fashion. Coordinating artillery barrages and infantry advances required checking the time with one glance, and officers in the First World War strapped their watches to their wrists. After the war, the wristwatch became an everyday object for everyone, later gaining luminous dials, automatic winding, water resistance and, eventually, digital displays and connections to the internet.

Looking back, each new way of keeping time changed the way people lived. Sundials tied the day to the sky, mechanical clocks organised towns around the bell tower, chronometers opened the oceans, railway time stitched nations together, and atomic clocks now hold up the invisible infrastructure of the modern world. The humble question of what time it is has driven some of the most inventive engineering in history, and it will surely continue to do so.
"""

LONG_QUESTION = (
    "\nQuestion: According to the essay above, who built the marine chronometer "
    "that solved the longitude problem, and in which year was it tested on a "
    "voyage to Jamaica?\nAnswer: The marine chronometer was built by"
)  # answer prefix keeps the model talking (a bare "Answer:" ends at once)

# Chat conversations rendered with the model's own chat template.
CHAT_SIMPLE = [{"role": "user", "content": "What is the tallest mountain in the world?"}]
CHAT_MULTI = [
    {"role": "system", "content": "You are a concise assistant. Answer in one sentence."},
    {"role": "user", "content": "Name a primary colour."},
    {"role": "assistant", "content": "Red is a primary colour."},
    {"role": "user", "content": "And another one?"},
]

# Plain-text generation prompts: (name, text).  Chat prompts are added later.
TEXT_PROMPTS = [
    ("capital_france", "The capital of France is"),
    ("factual_question",
     "Question: At what temperature does water boil at sea level, in degrees Celsius?\nAnswer:"),
    ("code_fibonacci", "def fibonacci(n):"),
    ("french_story", "Il était une fois, dans un petit village de Provence,"),
]
ONE_TOKEN_PROMPT = "Once"  # asserted below to be a single token


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------

def render_chat(template_src: str, messages: list[dict], bos: str, eos: str) -> str:
    """Render a chat template the way Hugging Face transformers does
    (sandboxed Jinja2, trim_blocks + lstrip_blocks, add_generation_prompt)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise RuntimeError(f"chat template error: {msg}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    tmpl = env.from_string(template_src)
    return tmpl.render(messages=messages, add_generation_prompt=True,
                       bos_token=bos, eos_token=eos)


class Golden:
    """Thin wrapper around one llama.cpp context with manual greedy decoding."""

    def __init__(self, model_path: str, threads: int):
        self.llm = Llama(
            model_path=model_path,
            n_ctx=N_CTX,
            n_batch=N_BATCH,
            n_ubatch=N_BATCH,
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=False,
            seed=SEED,
            verbose=False,
        )
        self.vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self.n_vocab = self.llm.n_vocab()

    # -- tokenizer -----------------------------------------------------------
    def tokenize(self, text: str, special: bool, add_bos: bool = False) -> list[int]:
        return [int(t) for t in self.llm.tokenize(text.encode("utf-8"),
                                                  add_bos=add_bos, special=special)]

    def is_eog(self, tok: int) -> bool:
        # llama_vocab_is_eog is the current name; llama_token_is_eog is the
        # deprecated alias kept by older bindings.
        fn = getattr(llama_cpp, "llama_vocab_is_eog", None) or llama_cpp.llama_token_is_eog
        return bool(fn(self.vocab, tok))

    def token_text(self, tok: int) -> str:
        return self.llm.detokenize([tok], special=True).decode("utf-8", errors="replace")

    # -- evaluation ------------------------------------------------------------
    def _last_logits(self) -> np.ndarray:
        """Copy of the logits of the last token of the most recent decode.
        With logits_all=False only that position has an output row."""
        ptr = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).astype(np.float32, copy=True)

    def _clear(self):
        # Drop the whole KV cache (metadata and data) so that every prompt
        # starts from an identical, empty state regardless of what ran before.
        self.llm.reset()
        mem = llama_cpp.llama_get_memory(self.llm.ctx)
        llama_cpp.llama_memory_clear(mem, True)

    def greedy(self, prompt_ids: list[int], n_predict: int):
        """Evaluate the prompt (in N_BATCH chunks, like llama.cpp's CLI) then
        decode greedily one token at a time.  Returns (first_logits, tokens,
        stop_reason, all_logits)."""
        assert len(prompt_ids) + n_predict <= N_CTX
        self._clear()
        self.llm.eval(prompt_ids)
        logits = self._last_logits()
        steps = [logits]
        out: list[int] = []
        stop = "length"
        while len(out) < n_predict:
            # np.argmax returns the first maximum, i.e. the lowest id on ties.
            tok = int(np.argmax(logits))
            out.append(tok)
            if self.is_eog(tok):
                stop = "eog"
                break
            if len(out) == n_predict:
                break
            self.llm.eval([tok])
            logits = self._last_logits()
            steps.append(logits)
        return steps[0], out, stop, np.stack(steps)


def top_logits(logits: np.ndarray, k: int) -> list[list]:
    """Top-k (id, logit), logit descending, id ascending on exact ties."""
    ids = np.arange(logits.shape[0])
    order = np.lexsort((ids, -logits.astype(np.float64)))[:k]
    return [[int(i), float(logits[i])] for i in order]


def to_json(obj, indent: int = 0) -> str:
    """JSON with objects spread over lines but arrays kept on one line, and
    each tokenize case on a single line: readable diffs, modest file size."""
    pad = " " * indent
    if isinstance(obj, dict):
        if "ids" in obj and "text" in obj:  # a tokenize case
            return json.dumps(obj, ensure_ascii=False)
        items = [f'{pad} {json.dumps(k)}: {to_json(v, indent + 1)}' for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list) and obj and isinstance(obj[0], dict):
        items = [pad + " " + to_json(v, indent + 1) for v in obj]
        return "[\n" + ",\n".join(items) + "\n" + pad + "]"
    return json.dumps(obj, ensure_ascii=False)


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="GGUF model file")
    ap.add_argument("--out", required=True, help="output JSON path")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default 2)")
    ap.add_argument("--dump-logits", metavar="NPZ",
                    help="also save every logits vector of the greedy loops (for run comparisons)")
    args = ap.parse_args()

    t_start = time.perf_counter()
    g = Golden(args.model, args.threads)
    meta = g.llm.metadata
    t_load = time.perf_counter() - t_start

    # Model-default BOS behaviour: what tokenize(add_bos=True) does.
    add_bos_model = bool(llama_cpp.llama_vocab_get_add_bos(g.vocab))
    bos_hello = g.tokenize("Hello", special=False, add_bos=True)

    # ---- tokenizer cases --------------------------------------------------
    tokenize_cases = [{"text": t, "special": False, "ids": g.tokenize(t, False)}
                      for t in TOKENIZE_TEXTS]
    for t in SPECIAL_TEXT_CASES:
        for special in (False, True):
            tokenize_cases.append({"text": t, "special": special, "ids": g.tokenize(t, special)})

    # ---- generation prompts -----------------------------------------------
    template = meta.get("tokenizer.chat_template")
    if not template:
        sys.exit("model has no tokenizer.chat_template")
    bos_id = llama_cpp.llama_vocab_bos(g.vocab)
    eos_id = llama_cpp.llama_vocab_eos(g.vocab)
    bos_str = g.token_text(bos_id) if bos_id >= 0 else ""
    eos_str = g.token_text(eos_id) if eos_id >= 0 else ""

    # Each entry: (name, prompt text, chat?, messages or None)
    prompts = [(name, text, False, None) for name, text in TEXT_PROMPTS]
    prompts.append(("chat_tallest_mountain", render_chat(template, CHAT_SIMPLE, bos_str, eos_str), True, CHAT_SIMPLE))
    prompts.append(("chat_multiturn_system", render_chat(template, CHAT_MULTI, bos_str, eos_str), True, CHAT_MULTI))
    prompts.append(("long_essay_question", LONG_ESSAY + LONG_QUESTION, False, None))
    prompts.append(("one_token", ONE_TOKEN_PROMPT, False, None))

    generate = []
    dumps = {}
    for name, text, chat, messages in prompts:
        # Chat prompts contain <|im_start|>/<|im_end|> that must be parsed as
        # special tokens; plain prompts are tokenized as ordinary text.  BOS
        # follows the model default (llama.cpp's own behaviour).
        ids = g.tokenize(text, special=chat, add_bos=add_bos_model)
        if name == "one_token" and len(ids) != 1:
            sys.exit(f"one_token prompt {text!r} tokenizes to {ids}")
        if name == "long_essay_question" and len(ids) < LONG_PROMPT_MIN_TOKENS:
            sys.exit(f"long prompt has only {len(ids)} tokens")
        t0 = time.perf_counter()
        first, out, stop, steps = g.greedy(ids, N_PREDICT)
        dt = time.perf_counter() - t0
        generate.append({
            "name": name,
            "prompt": text,
            "chat": chat,
            # the conversation the chat prompt was rendered from, so that pdmesh's own
            # template rendering can be checked against it
            **({"messages": messages} if messages else {}),
            "add_bos": add_bos_model,
            "prompt_ids": ids,
            "n_predict": N_PREDICT,
            "greedy": out,
            "greedy_text": g.llm.detokenize(out, special=True).decode("utf-8", errors="replace"),
            "stop": stop,
            "top_logits": top_logits(first, TOP_K_LOGITS),
            # sha256 of the raw float32 (little-endian) logits at the last
            # prompt position; detects any llama.cpp-side change on regeneration.
            "logits_sha": hashlib.sha256(first.astype("<f4").tobytes()).hexdigest(),
        })
        dumps[name] = steps
        print(f"  {name:24s} prompt {len(ids):5d} tok  generated {len(out):2d} ({stop:6s})  {dt:6.2f}s",
              file=sys.stderr)

    eog_ids = [t for t in range(g.n_vocab) if g.is_eog(t)]

    golden = {
        "generator": "tests/golden/make_golden.py",
        "llama_cpp_python": llama_cpp.__version__,
        "model_file": os.path.basename(args.model),
        "model_sha256": sha256_file(args.model),
        "config": {"n_ctx": N_CTX, "n_batch": N_BATCH, "n_ubatch": N_BATCH,
                   "n_threads": args.threads, "seed": SEED, "logits_all": False,
                   "flash_attn": False},
        "n_vocab": g.n_vocab,
        "bos_id": int(bos_id),
        "eos_id": int(eos_id),
        "eog_ids": eog_ids,
        "add_bos_default": add_bos_model,
        "add_bos_default_ids_for_hello": bos_hello,
        "chat_template": template,
        "tokenize": tokenize_cases,
        "generate": generate,
    }

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = args.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(to_json(golden) + "\n")
    os.replace(tmp, args.out)

    if args.dump_logits:
        np.savez(args.dump_logits, **dumps)

    total = time.perf_counter() - t_start
    print(f"make_golden: llama-cpp-python {llama_cpp.__version__}, {args.threads} thread(s), "
          f"model loaded in {t_load:.2f}s", file=sys.stderr)
    print(f"make_golden: {len(tokenize_cases)} tokenize cases, {len(generate)} generate prompts "
          f"(prompt lengths {[len(x['prompt_ids']) for x in generate]}), "
          f"{total:.1f}s total -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
