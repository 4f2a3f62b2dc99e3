"""kvfence.model: the Llama-family engine that prefill and decode run.

Modules (import them directly; this package imports nothing so that ``kvfence.model.tiny`` stays
cheap for static checks):

* ``loader``: ``load_model(path, dtype=, device=) -> LoadedModel`` (``.model``, ``.args``,
  ``.shape``, ``.fingerprint``, ``.eos_token_ids``), ``read_model_shape(path)``,
  ``fingerprint(path)``.
* ``llama``: ``ModelArgs``, ``Transformer`` (flat tokens + an ``attend`` callback per layer).
* ``args``: ``ModelArgs``, ``RopeSpec`` (no torch: the control plane reads a checkpoint's
  architecture; ``llama`` and ``rope`` re-export them).
* ``checkpoint``: ``read_config``, ``read_model_shape``, ``fingerprint``, ``text_fingerprint``,
  ``generation_eos`` (no torch; ``loader`` re-exports them).
* ``served``: ``model_dir(cfg)``, ``kv_layout(cfg, shape)``: the folder and KV layout a cluster
  serves (no torch; ``kvfence.node`` re-exports them); ``embedded_model_dir(cfg)``, where the
  embedded model goes, resolved without writing it.
* ``engine``: ``Engine(model, pool)`` with ``prefill(token_ids, pages)``, ``prefill_many`` (several
  prompts in one forward pass) and ``decode_step([DecodeItem]) -> (logits, error_flags)``;
  ``DecodeBatch(engine)`` keeps a decode loop's block tables as tensors between steps (``sync``,
  ``step``, ``step_and_sample``): the scheduler and the decode node's batcher step through it.
* ``sampling``: ``SamplingParams``, ``sample``/``sample_one`` (seeded by request seed and step);
  it re-exports ``stops``' functions.
* ``stops``: ``find_stop``, ``stream_safe_len`` (no torch: the control plane uses them).
* ``scheduler``: ``Scheduler`` (continuous batching; ``add``, ``add_prefilled``, ``abort``,
  ``step``), ``SequenceStatus``, ``StepOutput``.
* ``colocated``: ``ColocatedEngine.generate`` (the differential-test reference), ``logit_gaps``.
* ``tiny``: ``TINY_CONFIG``, ``write_tiny_model(dir)``, ``ensure_tiny_model(dir=None)``,
  ``tiny_model_complete(dir)`` (no torch); ``python -m kvfence.model.tiny DIR`` writes it.
"""
