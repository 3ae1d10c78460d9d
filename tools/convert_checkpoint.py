"""Convert between megaloop checkpoints and Hugging Face directories (megaloop.hf).

    python tools/convert_checkpoint.py to-hf CHECKPOINT OUT [--config RUN.yaml]
                                       [--tokenizer FILE | --no-tokenizer]
                                       [--dtype {float32,bfloat16,float16}]
    python tools/convert_checkpoint.py from-hf HF_DIR OUT

to-hf: CHECKPOINT is a checkpoint (iter_N) of any TP/PP/EP layout, or a checkpoint directory with a
``latest`` pointer (or that pointer). OUT gets safetensors, config.json, generation_config.json and
the run's tokenizer (data.tokenizer_model, or --tokenizer; --no-tokenizer writes none, and
config.json's eos_token_id is still the run's end-of-document id); a Dense model loads as a native
transformers class where one fits, every other one as remote code:
``AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)``. --config (its model section):
refuses a checkpoint of another architecture than that run config's, naming each field; its
settings that a loaded checkpoint lets change (model.iterations for another test-time depth,
seq_length, rotary_base, ...) are exported, named with the trained values in one warning line on
stderr and listed in the report's settings_from_config. A Hugging Face directory given is named
as such (from-hf converts that direction).
--dtype: what the safetensors hold and config.json's ``dtype`` (what ``from_pretrained`` loads in);
by default the dtype the checkpoint holds its weights in (bfloat16 after a bf16 run), which loses
nothing.

from-hf: OUT becomes a checkpoint directory that a run starts from with
``checkpoint.load=OUT checkpoint.load_optimizer=false``; it holds the weights in the dtype
HF_DIR's safetensors do.

Both write into a temporary directory beside OUT and rename it only after the converted model's
logits on a probe input equal the source's. Prints a JSON report; exits 2 on bad input (one line
naming the file or tensor) and 1 when the probe logits differ; SIGTERM ends a conversion with exit
143, its temporary directory removed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="direction", required=True)
    to_hf = sub.add_parser("to-hf", help="megaloop checkpoint -> Hugging Face directory",
                           allow_abbrev=False)
    to_hf.add_argument("checkpoint")
    to_hf.add_argument("out")
    to_hf.add_argument("--config", help="run config YAML whose model the checkpoint must match; its "
                       "test-time depth, context, ... are exported")
    tokenizer = to_hf.add_mutually_exclusive_group()
    tokenizer.add_argument("--tokenizer", help="tokenizer file instead of data.tokenizer_model")
    tokenizer.add_argument("--no-tokenizer", action="store_true", help="write no tokenizer files")
    # Checked by export_checkpoint (one line, exit 2), not by argparse (usage and error, 3 lines).
    to_hf.add_argument("--dtype", metavar="{float32,bfloat16,float16}",
                       help="dtype of the exported weights (default: the checkpoint's)")
    from_hf = sub.add_parser("from-hf", help="Hugging Face directory -> megaloop checkpoint",
                             allow_abbrev=False)
    from_hf.add_argument("hf_dir")
    from_hf.add_argument("out")
    args = parser.parse_args(argv)

    from megaloop.config import ConfigError, load_yaml
    from megaloop.data.tokenizer import TokenizerError
    from megaloop.hf.common import ConversionError, ProbeMismatch, quiet_transformers
    from megaloop.cli import log_to_stderr, quiet_third_party_warnings
    from megaloop.training.checkpoint import CheckpointError

    quiet_third_party_warnings()
    log_to_stderr()
    quiet_transformers()
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout is the JSON report only
            if args.direction == "to-hf":
                from megaloop.hf.to_hf import export_checkpoint

                requested = load_yaml(args.config).model if args.config else None
                report = export_checkpoint(args.checkpoint, args.out, requested=requested,
                                           tokenizer=args.tokenizer,
                                           with_tokenizer=not args.no_tokenizer,
                                           dtype=args.dtype)
            else:
                from megaloop.hf.from_hf import import_hf

                report = import_hf(args.hf_dir, args.out)
    except (ConversionError, CheckpointError, ConfigError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ProbeMismatch as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
