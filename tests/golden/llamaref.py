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
