"""kvserve: one Python LLM inference server (llama-server, OpenAI and Ollama APIs) over a paged-KV engine."""

import os as _os

__version__ = "0.1.0"

# How torch's OpenMP threads wait between parallel regions (a decode step has a
# few hundred of them). Waking a sleeping thread costs ~50-80 us on these VMs, so
# passive waiting (OMP_WAIT_POLICY=PASSIVE) halves decode speed on an idle
# machine: 31 -> 60 tok/s for one stream, 170 -> 290 for 16 on a 2-core EPYC.
# libgomp's default spins ~300k iterations, which stalls every step when other
# processes share the cores (measured: 53 ms -> 1.8 s a step). A short, bounded
# spin (GOMP_SPINCOUNT=3000, tens of microseconds) keeps the idle-machine speed
# and costs about 30% under full contention (2 busy processes on 2 cores), where
# PASSIVE does better: set OMP_WAIT_POLICY=PASSIVE for a shared machine. Applied
# before torch loads, only when neither variable is set.
# Intel's OpenMP (some torch builds) ignores GOMP_SPINCOUNT and spins 200 ms by
# default: KMP_BLOCKTIME=0 keeps it passive there, as before.
if "OMP_WAIT_POLICY" not in _os.environ and "GOMP_SPINCOUNT" not in _os.environ:
    _os.environ["GOMP_SPINCOUNT"] = "3000"
    _os.environ.setdefault("KMP_BLOCKTIME", "0")

from kvserve import bytecode_cache as _bytecode_cache  # noqa: E402

_bytecode_cache.install()  # kvserve's compiled modules kept across starts when Python writes no .pyc files

from kvserve.engine.request import SamplingParams  # noqa: E402


def __getattr__(name):
    if name == "LLM":
        from kvserve.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "__version__"]
