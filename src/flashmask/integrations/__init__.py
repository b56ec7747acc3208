"""Training integrations: a Hugging Face transformers attention backend and data collators.

Submodules are imported on demand so that ``import flashmask`` never imports transformers:

* :mod:`flashmask.integrations.transformers`: importing it registers ``"flashmask"`` with
  transformers' ``AttentionInterface`` (and ``AttentionMaskInterface``), so
  ``AutoModelForCausalLM.from_pretrained(..., attn_implementation="flashmask")`` works.
* :mod:`flashmask.integrations.data`: packing collators for SFT (best-fit decreasing, causal
  document masks) and shared-prompt preference data (DPO, reward models), plus the DPO and
  Bradley-Terry losses computed from that layout. Needs only torch.
"""
