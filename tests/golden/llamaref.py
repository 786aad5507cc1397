"""Helpers shared by the scripts that take reference data from llama.cpp (through
llama-cpp-python): file hashes, and turning llama.cpp's extra buffer types off (weight
repacking, AMX: they crash on AMX hosts, ENVIRONMENT.md, and would change which kernels the
reference runs)."""
import hashlib

import llama_cpp
import llama_cpp.llama as llama_mod


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def disable_extra_bufts() -> bool:
    """Turns llama.cpp's extra buffer types off for every model llama-cpp-python loads from
    now on; False when this version has no such parameter. Llama() takes its model parameters
    from llama_model_default_params(), so the default is patched where llama.py looks it up."""
    probe = llama_cpp.llama_model_default_params()
    if not hasattr(probe, "use_extra_bufts"):
        return False
    original = llama_cpp.llama_cpp.llama_model_default_params

    def params_without_extra_bufts():
        p = original()
        p.use_extra_bufts = False
        return p

    llama_mod.llama_cpp.llama_model_default_params = params_without_extra_bufts
    return True


def token_logprobs(model_path: str, tokens: list, n_ctx: int = 512) -> list:
    """llama.cpp's log p(tokens[i] | tokens[:i]) for every i >= 1 (None for i = 0), from one
    evaluation with logits_all, log_softmax in double precision, one thread, the extra buffer
    types off (the kernels llama-perplexity uses)."""
    import math
    disable_extra_bufts()
    llm = llama_cpp.Llama(model_path=model_path, n_ctx=max(n_ctx, len(tokens)),
                          n_batch=max(n_ctx, len(tokens)), logits_all=True, n_threads=1,
                          verbose=False)
    llm.eval(tokens)
    out = [None]
    for i in range(1, len(tokens)):
        row = llm.scores[i - 1]
        mx = max(row)
        lse = mx + math.log(sum(math.exp(v - mx) for v in row))
        out.append(float(row[tokens[i]]) - lse)
    llm.close() if hasattr(llm, "close") else None
    return out
