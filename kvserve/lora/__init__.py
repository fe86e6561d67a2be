"""LoRA adapters: A/B weights (float32, or float16/bfloat16 with ``--lora-dtype``) beside the (packed) base
model, never merged into it.

What each piece does (llama-server's, vLLM's and Ollama's LoRA features build on these):

- :func:`load_adapter` reads a PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``:
  ``r``, ``lora_alpha``, ``target_modules``, ``use_rslora``, ``rank_pattern`` / ``alpha_pattern``) or a
  llama.cpp LoRA GGUF (``general.type`` "adapter", ``adapter.type`` "lora", ``adapter.lora.alpha``,
  tensors ``blk.N.attn_q.weight.lora_a`` / ``.lora_b`` as ``convert_lora_to_gguf.py`` writes them) and
  checks it against the base model (architecture, every module's shape). It returns a
  :class:`LoraAdapter`; every problem is a :class:`kvserve.errors.InvalidInputError` whose message
  names the file and, for a shape problem, the module.
- :class:`LoraRegistry` is one engine's set of adapters (``ModelRunner.lora``; the serving layer's
  ``Runner.lora``): ``add(adapter, scale=1.0) -> id``, ``remove(name_or_id)``, ``get(name)``,
  ``entries()`` (id, name, path, scale), ``set_scales({id: scale})`` (llama-server's global scales),
  ``resolve(lora)`` (a request's list checked and normalized), and the limits ``max_loras`` (most
  distinct adapters in one engine step; None = no limit, as llama-server, which applies every loaded
  adapter at once; vLLM's ``--max-loras`` sets it) and ``max_lora_rank`` (None = no limit; vLLM's
  ``--max-lora-rank`` sets it). Ids count up from 0 in the order adapters are added (llama-server's
  ids for ``--lora`` files) and are never reused by one registry, so an id names one adapter's
  weights for the engine's lifetime (the prefix cache keys blocks by it).

How a request asks for adapters (the engine's side of it):

``kvserve.engine.request.Request.lora`` is a tuple of ``(adapter id, scale)`` pairs: the adapters
whose deltas this request's rows get, each times its scale (llama-server's per-request
``lora: [{"id": N, "scale": S}]``: several adapters at once; vLLM / Ollama: one adapter, scale 1.0).
An empty tuple (the default) is the base model. The serving layer's ``CompletionRequest.lora`` and
``ChatRequest.lora`` carry the same tuple down (None = the registry's global scales,
:meth:`LoraRegistry.default_lora`). Build the tuple with :meth:`LoraRegistry.resolve`, which checks
the ids and scales (unknown id, NaN, out of range: InvalidInputError) and drops zero scales; a face
routing a vLLM ``model`` name to an adapter does::

    entry = runner.lora.get(name)                 # LoraEntry or None
    lora = runner.lora.resolve([(entry.id, 1.0)])  # -> ((entry.id, 1.0),)

Adapters chosen by name on a runner that also serves the base (vLLM's ``--lora-modules`` /
``/v1/load_lora_adapter``) should be added with ``scale=0.0``: the global scales apply to every
request that names no adapters (llama-server's semantics), so an adapter added with scale 1.0 would
change the base model's answers too. (A runner of its own for base + adapter, as an Ollama model
with an adapter layer could be, adds it with 1.0.) Start-up adapters travel in ``ModelSpec.adapters`` (``(path, global
scale)`` pairs, loaded by ``kvserve.serving.chat_runner.load_adapters`` with the runner, a failure
failing the load); ``LoraRegistry.nbytes`` is their memory.

The engine (:mod:`kvserve.lora.apply`) adds ``(x @ A^T) @ B^T * module_scale * scale`` to each target
projection's output for the rows of that request; one step mixes rows of several adapters and of
none. ``module_scale`` is ``alpha / r`` (``alpha / sqrt(r)`` with rslora; a GGUF adapter's alpha of 0
means 1, as llama.cpp). The prefix cache keys blocks by the request's ``lora`` tuple (ids and
scales), so KV computed under one adapter is never reused under another or the base.
"""

from kvserve.lora.adapter import LoraAdapter, LoraBase, LoraModule, load_adapter
from kvserve.lora.registry import MAX_SCALE, LoraEntry, LoraRegistry

__all__ = ["LoraAdapter", "LoraBase", "LoraModule", "load_adapter", "LoraEntry", "LoraRegistry", "MAX_SCALE"]
