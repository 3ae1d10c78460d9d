"""LoopedLM: the canonical megatron-core definition of Dense, Full Loop and AsymLoop.

    h   = Embed(x)
    H_E = Encoder(h)                          E layers, once (absent for Dense / Full Loop)
    G   = [layer.project_global_kv(H_E)]      once per forward, one entry per decoder layer
    z_K = iterate(Decoder, H_E, K, G)         D weight-tied layers, K times (the one recurrence primitive)
    logits = OutputLayer(FinalNorm(z_K))

Dense is the special case E = 0, K = 1 and Full Loop E = 0, K = R. The model is single-device code in
the torchtitan sense: tensor parallelism lives in the megatron-core layers it is built from, and
data/pipeline parallelism, checkpointing and logging are applied from outside.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.utils import init_method_normal, scaled_init_method_normal

from megaloop.config import ModelConfig, ParallelConfig
from megaloop.models import moe, specs
from megaloop.models.recurrence import iterate


# megaloop's FP8 recipe names (config.Fp8Recipe) -> megatron-core's.
_MCORE_FP8_RECIPES = {"current": "tensorwise", "delayed": "delayed", "mxfp8": "mxfp8"}


def transformer_config(cfg: ModelConfig, parallel: ParallelConfig, num_layers: int,
                       ffn_hidden_size: int, params_dtype=torch.float32,
                       fp8: str | None = None, use_te: bool = False) -> TransformerConfig:
    """The megatron-core TransformerConfig for one block of ``num_layers`` physical layers.

    ``fp8`` (Transformer Engine only; None: off) names the scaling recipe, E4M3 forward / E5M2
    backward; megatron-core's TransformerBlock then runs each call of the block under
    fp8_autocast. A looped block is called K times per forward, and delayed scaling updates its
    scales after every call: its amax history spans 2K calls and takes their maximum, so that
    iteration t is not quantised with iteration t-1's amax alone (TE's default, a history of 1).
    MoE models carry the MoE fields in every block's config (megatron-core's schedules read them
    from the model's config to scale the auxiliary losses); ``use_te`` selects grouped-GEMM
    experts."""
    on_gpu = torch.cuda.is_available()
    recompute = parallel.recompute == "full"
    fp8_settings = {}
    if fp8 is not None:
        if fp8 not in _MCORE_FP8_RECIPES:
            raise ValueError(f"fp8={fp8!r}: must be one of {', '.join(_MCORE_FP8_RECIPES)} or None")
        fp8_settings = dict(fp8="hybrid", fp8_recipe=_MCORE_FP8_RECIPES[fp8])
        if fp8 == "delayed":
            fp8_settings.update(fp8_amax_history_len=2 * cfg.num_iterations,
                                fp8_amax_compute_algo="max")
    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.kv_channels,
        normalization="RMSNorm",
        # Tells finalize_model_grads to sum QK-norm weight gradients over tensor-parallel ranks
        # (each rank sees only its own heads).
        qk_layernorm=bool(cfg.qk_norm),
        layernorm_epsilon=cfg.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method=init_method_normal(cfg.init_std),
        # Residual-branch outputs are scaled by the *effective* depth, the number of layer
        # applications the residual stream accumulates, not the physical layer count.
        output_layer_init_method=scaled_init_method_normal(cfg.init_std, cfg.effective_depth),
        init_method_std=cfg.init_std,
        tensor_model_parallel_size=parallel.tensor,
        pipeline_model_parallel_size=parallel.pipeline,
        expert_model_parallel_size=parallel.expert,
        sequence_parallel=parallel.sequence_parallel,
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,  # dtype of the activations pipeline stages exchange
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=not on_gpu,
        perform_initialization=True,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=on_gpu,
        bias_dropout_fusion=on_gpu,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        **fp8_settings,
        **moe.transformer_config_fields(cfg, grouped_gemm=use_te),
    )


class LoopedLM(LanguageModule):
    def __init__(self, cfg: ModelConfig, parallel: ParallelConfig | None = None,
                 use_te: bool | None = None, params_dtype=torch.float32, parallel_output: bool = True,
                 pre_process: bool = True, post_process: bool = True, fp8: str | None = None):
        """``pre_process`` / ``post_process``: this pipeline stage holds the embedding / the head.

        Pipeline parallelism: Dense splits its layers evenly over the stages; AsymLoop takes two
        stages split where the recurrence starts, embedding + encoder on the first and Global KV +
        the K-times decoder + head on the last, so that the loop never crosses a stage.
        """
        cfg = dataclasses.replace(cfg).resolve()
        parallel = parallel or ParallelConfig()
        use_te = specs.transformer_engine_available() if use_te is None else use_te
        enc_layers, dec_layers = cfg.num_encoder_layers, cfg.num_decoder_layers
        self_contained_blocks = cfg.arch == "asymloop" and parallel.pipeline > 1
        # Each block of a stage split lives whole on one stage: its own config says "no pipeline",
        # so megatron-core builds all of its layers, numbered from 1 as without pipelining (and
        # checkpoints keep the same keys in every layout).
        block_parallel = (dataclasses.replace(parallel, pipeline=1) if self_contained_blocks
                          else parallel)
        model_config = transformer_config(cfg, parallel, dec_layers, cfg.decoder_ffn_hidden_size,
                                          params_dtype, fp8, use_te)
        dec_config = (transformer_config(cfg, block_parallel, dec_layers,
                                         cfg.decoder_ffn_hidden_size, params_dtype, fp8, use_te)
                      if self_contained_blocks else model_config)
        super().__init__(config=model_config)
        self.cfg = cfg
        self.model_type = ModelType.encoder_or_decoder  # what megatron-core's schedules expect
        self.pre_process, self.post_process = pre_process, post_process
        self.self_contained_blocks = self_contained_blocks
        self.stage_input: torch.Tensor | None = None
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = cfg.tie_embeddings
        self.vocab_size = cfg.vocab_size
        self.max_sequence_length = cfg.seq_length

        if pre_process:
            self.embedding = LanguageModelEmbedding(
                config=model_config, vocab_size=cfg.vocab_size, max_sequence_length=cfg.seq_length,
                position_embedding_type="rope",
            )
        self.rotary_pos_emb = RotaryEmbedding(
            kv_channels=cfg.kv_channels, rotary_percent=1.0, rotary_base=cfg.rotary_base,
            use_cpu_initialization=model_config.use_cpu_initialization,
        )
        self.encoder = self.decoder = None
        if enc_layers and (pre_process or not self_contained_blocks):
            enc_config = transformer_config(cfg, block_parallel, enc_layers, cfg.ffn_hidden_size,
                                            params_dtype, fp8, use_te)
            self.encoder = TransformerBlock(
                enc_config, specs.layer_spec(cfg, "plain", use_te, moe=cfg.moe_in("encoder")),
                post_layer_norm=False)
        if post_process or not self_contained_blocks:
            decoder_spec = specs.layer_spec(cfg, cfg.decoder_attention, use_te,
                                            moe=cfg.moe_in("decoder"), layer_offset=enc_layers)
            self.decoder = TransformerBlock(
                dec_config, decoder_spec, post_layer_norm=False,
                pre_process=pre_process or self_contained_blocks, post_process=post_process)
        if post_process:
            self.final_layernorm = build_module(specs.final_norm_spec(use_te), config=model_config,
                                                hidden_size=cfg.hidden_size, eps=cfg.norm_eps)
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                cfg.hidden_size, cfg.vocab_size, config=model_config,
                init_method=model_config.init_method, bias=False, skip_bias_add=False,
                gather_output=not parallel_output,
                skip_weight_param_allocation=pre_process and cfg.tie_embeddings,
            )
        self.setup_embeddings_and_output_layer()
        self.routing_stats = self._attach_routing_stats(
            ([self.first_group] if enc_layers else [])
            + [f"{self.loop_group}{t}" for t in range(1, cfg.iterations + 1)])

    # MoE statistics labels of the block before the loop and of the loop's steps.
    first_group, loop_group = "encoder", "iter"

    def _attach_routing_stats(self, groups: list[str]) -> moe.RoutingStats | None:
        """Per-application MoE routing statistics (None for a dense model); the trainer reports
        them each step."""
        if not self.cfg.uses_moe:
            return None
        # megatron-core keeps the auxiliary-loss gradient scale in a class attribute that its
        # schedules set per step; a new model starts from its default (1) whatever an earlier model
        # of this process left there (a 0-d tensor from a plain backward, which the schedules'
        # [1]-shaped scale cannot be copied into).
        MoEAuxLossAutoScaler.main_loss_backward_scale = None
        stats = moe.RoutingStats(groups, self.cfg.num_experts)
        for router in moe.routers(self):
            router.stats = stats
        return stats

    def applying(self, group: str):
        """Context labelling the MoE applications inside it (a no-op for a dense model)."""
        if self.routing_stats is None:
            return contextlib.nullcontext()
        return self.routing_stats.applying(group)

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline schedules hand a non-first stage its input activations here."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        if self.self_contained_blocks:
            self.stage_input = input_tensor  # H_E from the encoder stage
        elif self.decoder is not None:
            self.decoder.set_input_tensor(input_tensor)

    def global_kv(self, encoder_output: torch.Tensor, rotary_pos_emb) -> torch.Tensor:
        """Global KV of every decoder layer, stacked on dim 0: [D, N, B, groups, 2 * head_dim]."""
        return torch.stack([layer.self_attention.project_global_kv(encoder_output, rotary_pos_emb)
                            for layer in self.decoder.layers])

    def loop(self, hidden: torch.Tensor, rope: torch.Tensor, steps: int) -> torch.Tensor:
        """The weight-tied decoder K times (Full Loop: the stack R times), after the Global KV."""
        cfg = self.cfg
        context = self.global_kv(hidden, rope) if cfg.uses_global_kv else None
        additive = cfg.arch == "asymloop" and cfg.injection == "additive"
        return iterate(self.decoder, hidden, steps, additive=additive,
                       step_context=lambda t: self.applying(f"{self.loop_group}{t}"),
                       attention_mask=None, context=context, rotary_pos_emb=rope)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                num_iterations: int | None = None) -> torch.Tensor:
        """Returns logits [B, N, V/tp] or, with ``labels``, per-token losses [B, N].

        ``num_iterations`` overrides K (or R) for test-time depth scaling. Attention is causal by
        construction; ``attention_mask`` is accepted for megatron-core's calling convention only.
        """
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        steps = self.cfg.iterations if num_iterations is None else num_iterations
        if steps < 1:
            raise ValueError(f"num_iterations={steps}: must be >= 1")
        if self.pre_process:
            hidden = self.embedding(input_ids=input_ids, position_ids=position_ids)  # [N, B, h]
        else:  # None for Dense: its decoder block reads the tensor the schedule handed over
            hidden = self.stage_input
        rope = self.rotary_pos_emb(input_ids.shape[1])
        if self.encoder is not None:
            with self.applying(self.first_group):
                hidden = self.encoder(hidden, attention_mask=None, rotary_pos_emb=rope)
        if self.decoder is None:  # the encoder stage of a pipeline split sends H_E on
            return hidden
        hidden = self.loop(hidden, rope, steps)
        if not self.post_process:
            return hidden
        hidden = self.final_layernorm(hidden)
        weight = self.shared_embedding_or_output_weight() if self.cfg.tie_embeddings else None
        logits, _ = self.output_layer(hidden, weight=weight)
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        return self.compute_language_model_loss(labels, logits)


def model_class(cfg: ModelConfig) -> type[LoopedLM]:
    """LoopedLM, or its LatentLoop subclass for arch=latentloop."""
    if cfg.arch == "latentloop":
        from megaloop.models.latent import LatentLoopLM

        return LatentLoopLM
    return LoopedLM


def build_model(cfg: ModelConfig, parallel: ParallelConfig | None = None, **kwargs) -> LoopedLM:
    """Validates the configuration, then builds the model (model-parallel groups must exist)."""
    cfg = dataclasses.replace(cfg)
    cfg.validate()
    if parallel is not None:
        parallel.validate(cfg)
    return model_class(cfg)(cfg, parallel, **kwargs)
