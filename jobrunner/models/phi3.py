"""Phi-3 / Phi-3.5 (``Phi3ForCausalLM``, model_type ``phi3``) on our Llama-family decoder: config switches only.

Read against transformers 5.24's ``models/phi3/modeling_phi3.py``, a Phi-3 layer is our Llama layer:
- its checkpoint is already fused, ``self_attn.qkv_proj`` rows q | k | v and ``mlp.gate_up_proj`` rows gate | up
  (``chunk(2)``, then ``up * act(gate)``): the order of our fused layers, so the loader copies them whole;
- RMSNorm, residuals (its dropouts are identity at inference), no biases, untied head unless the config ties it;
- ``sliding_window`` (Phi-3-mini-4k: 2047) on every layer, through ``create_sliding_window_causal_mask``: a query
  sees the last ``sliding_window`` positions, itself included, as Mistral's (``llama._sliding_window``);
- rope ``default`` or ``longrope`` (``su`` / ``yarn`` in older configs; two factor sets, see ``models/rope.py`` and
  ``engine/long_rope.py``). ``partial_rotary_factor`` is 1.0 in every Phi-3 / 3.5 config; another value (Phi-4-mini's
  0.75) is refused by ``rope.inv_freq_and_scaling``.
"""

from __future__ import annotations

ARCHITECTURE = "Phi3ForCausalLM"


def check_config(config) -> None:
    """Refuse what our decoder would compute differently (a ValueError naming the field)."""
    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"{ARCHITECTURE}: hidden_act={act!r} is not supported; supported: silu")
