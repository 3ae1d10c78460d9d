"""Hugging Face export and import of megaloop checkpoints (tools/convert_checkpoint.py).

- ``to_hf``: a megaloop dist checkpoint of any parallel layout -> a Hugging Face directory: a native
  transformers class where one computes the same function (``native``), else megaloop's reference
  model (megaloop/reference) shipped as remote code; safetensors, config, generation config and the
  run's tokenizer.
- ``from_hf``: such a directory (or a native Llama / Qwen3 / OLMo 2 / Mixtral / Qwen3-MoE one) -> a
  megaloop checkpoint the trainer starts from (``checkpoint.load``, weights only).
Both directions stage into a temporary directory beside the output, compare the logits of a probe
input before and after (``probe``), and rename the directory into place only when they agree.
- ``evaluate``: the LM Evaluation Harness on such a model, offline, from the local task files of
  examples/eval (tools/evaluate.py, train.downstream_eval).
"""
