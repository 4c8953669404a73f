"""Adapters that let serving engines and training frameworks call kdakit with the signatures they already use.

Each submodule reproduces one caller's function signatures and defaults exactly and maps the arguments onto
kdakit's public functions (`kdakit.chunk_kda`, `kdakit.fused_recurrent_kda`, `kdakit.fused_recurrent_kda_fwd`); none
computes anything itself. Forms kdakit does not serve raise a clear error instead of being ignored.

- `kdakit.integrations.vllm`: `chunk_kda`, `chunk_kda_with_fused_gate`, `fused_recurrent_kda` as vLLM's vendored
  FLA ops define them (v-first pools, in place by default, slot 0 / negative slots as padding).
- `kdakit.integrations.sglang`: `chunk_kda` (pool + `initial_state_indices`, returns `o`) and
  `fused_sigmoid_gating_delta_rule_update(is_kda=True, ...)`.
- `kdakit.integrations.hf`: the `chunk_kda` / recurrent functions HF transformers' Kimi Linear calls, and
  `enable()` to swap them into `modeling_kimi_linear`.
- `kdakit.integrations.fla`: a backend for FLA's backend registry; `enable()` registers it.

The submodules import torch when imported (`fla.enable()` imports FLA); this package itself imports nothing.
"""

__all__ = ["fla", "hf", "sglang", "vllm"]
