"""LoopedLM: the canonical megatron-core definition of Dense, Full Loop and AsymLoop.

    h   = Embed(x)
    H_E = Encoder(h)                          E layers, once (absent for Dense / Full Loop)
    G   = [layer.project_global_kv(H_E)]      once per forward, one entry per decoder layer
    z_K = iterate(Decoder, H_E, K, G)         D weight-tied layers, K times (the one recurrence primitive)
    logits = OutputLayer(FinalNorm(z_K))

Dense is the special case E = 0, K = 1 and Full Loop E = 0, K = R. The model is single-device code in
the torchtitan sense: tensor parallelism lives in the megatron-core layers it is built from, and
data parallelism, checkpointing and logging are applied from outside. Under pipeline parallelism
one LoopedLM is one stage: its piece of the unrolled chain of layer applications
(megaloop.models.pipeline), holding the layers it runs; decoder layers run on several stages are
tied copies there (megaloop.training.tied).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch
import torch.nn.functional as F
from megatron.core import fp8_utils, tensor_parallel
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.spec_utils import build_module
from megatron.core.utils import init_method_normal, scaled_init_method_normal

from megaloop.config import ConfigError, ModelConfig, ParallelConfig
from megaloop.models import moe, pipeline, specs
from megaloop.models.build_device import builds_on_gpu
from megaloop.models.joint_attention import runs_masked_formula
from megaloop.models.layers import LayerBlock
from megaloop.models.recurrence import Segment, run_segments

log = logging.getLogger("megaloop.models")

# megaloop's FP8 recipe names (config.Fp8Recipe) -> megatron-core's.
_MCORE_FP8_RECIPES = {"current": "tensorwise", "delayed": "delayed", "mxfp8": "mxfp8"}


def transformer_config(cfg: ModelConfig, parallel: ParallelConfig, num_layers: int,
                       ffn_hidden_size: int, params_dtype=torch.float32,
                       fp8: str | None = None, use_te: bool = False,
                       initialize: bool = True) -> TransformerConfig:
    """The megatron-core TransformerConfig for one block of ``num_layers`` physical layers.

    ``fp8`` (Transformer Engine only; None: off) names the scaling recipe, E4M3 forward / E5M2
    backward; megatron-core's TransformerBlock then runs each call of the block under
    fp8_autocast (and LoopedLM.global_kv the Global K/V projections). A looped block is called
    K times per forward, and delayed scaling updates its scales after every call: its amax
    history spans 2K calls and takes their maximum, so that iteration t is not quantised with
    iteration t-1's amax alone (TE's default, a history of 1).
    MoE models carry the MoE fields in every block's config (megatron-core's schedules read them
    from the model's config to scale the auxiliary losses); ``use_te`` selects grouped-GEMM
    experts. ``initialize=False`` leaves the weights megatron-core allocates uninitialised
    (``perform_initialization``): for a model every weight of which is loaded next."""
    on_gpu = builds_on_gpu()
    full = parallel.recompute == "full"
    selective = parallel.selective_modules
    # moe_act: megatron-core replays only grouped-GEMM experts' activation; layernorm: its
    # CheckpointWithoutOutput (0.16.1) calls Transformer Engine's FP8 state unconditionally.
    needs_te = {"moe_act": "grouped-GEMM experts; recompute CPU experts with 'moe'",
                "layernorm": "megatron-core's norm replay calls Transformer Engine"}
    # Transformer Engine's spec fuses every pre-norm into the linear after it (specs.layer_spec):
    # megatron-core then replays only a MoE layer's pre-FFN norm, which the router reads, and
    # skips the fused ones without a word.
    if "layernorm" in selective and not cfg.uses_moe:
        raise ConfigError(f"parallel.recompute_modules={selective}: 'layernorm' replays nothing "
                          "in a model without MoE layers (Transformer Engine, which the norm "
                          "replay needs, fuses every pre-norm into the linear after it; only a "
                          "MoE layer's pre-FFN norm stands alone)")
    for name in selective:
        if name in needs_te and not use_te:
            raise ConfigError(f"parallel.recompute_modules={selective}: {name!r} needs the "
                             f"Transformer Engine spec on a CUDA GPU ({needs_te[name]})")
    fp8_settings = {}
    if fp8 is not None:
        if fp8 not in _MCORE_FP8_RECIPES:
            raise ValueError(f"fp8={fp8!r}: must be one of {', '.join(_MCORE_FP8_RECIPES)} or None")
        if not use_te:  # the local spec would accept the FP8 fields and ignore them
            raise ValueError(f"fp8={fp8!r}: needs the Transformer Engine spec (use_te=True, a CUDA "
                             "GPU with Transformer Engine); megatron-core's local modules would "
                             "run in the parameters' dtype")
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
        virtual_pipeline_model_parallel_size=(parallel.virtual_pipeline
                                              if parallel.virtual_pipeline > 1 else None),
        # The interleaved schedule on 2 pipeline ranks sends activations and gradients to the
        # same peer in one step; batched p2p issues them in an order the peer does not receive
        # them in (an activation arrives as a gradient), megatron-core's unbatched pairing does.
        batch_p2p_comm=not (parallel.virtual_pipeline > 1 and parallel.pipeline == 2),
        expert_model_parallel_size=parallel.expert,
        sequence_parallel=parallel.sequence_parallel,
        # Full: every layer replayed one at a time; selective: megatron-core's checkpoint around
        # the named submodules of every layer (megaloop's joint attention included, layers.py).
        recompute_granularity="full" if full else "selective" if selective else None,
        recompute_method="uniform" if full else None,
        recompute_num_layers=1 if full else None,
        recompute_modules=selective or None,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,  # dtype of the activations pipeline stages exchange
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=not on_gpu,
        perform_initialization=initialize,
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
                 fp8: str | None = None, stage: int = 0, initialize: bool = True):
        """``stage``: the pipeline stage this model is, v * pipeline + p for model chunk v of
        pipeline rank p (megaloop.models.pipeline): it holds the embedding if it is the first
        stage, the head if it is the last, and the layers its piece of the unrolled layer chain
        runs. Without pipeline parallelism the one stage holds everything.
        ``initialize=False``: the weight matrices are left as allocated (torch.empty), not drawn
        at random, for a model all of whose weights are loaded next (megaloop.api.load_with,
        which checks that the checkpoint filled every one); norms and scales still start at
        their constants, which cost nothing.
        """
        cfg = dataclasses.replace(cfg).resolve()
        parallel = parallel or ParallelConfig()
        check_parallel_groups(parallel)
        use_te = specs.transformer_engine_available() if use_te is None else use_te
        note_fp32_joint_attention(cfg, params_dtype)
        note_flash_core_attention_recompute(cfg, parallel, params_dtype)
        enc_layers, dec_layers = cfg.num_encoder_layers, cfg.num_decoder_layers
        stages = pipeline.plan_stages(cfg, pipeline.stage_counts(cfg, parallel))
        this = stages[stage]
        # The model's config carries the pipeline sizes (the schedules and the embedding tie read
        # them); each block's says "no pipeline", so that megatron-core builds exactly the layers
        # it is given, numbered as in the whole block (LayerBlock).
        model_config = transformer_config(cfg, parallel, dec_layers, cfg.decoder_ffn_hidden_size,
                                          params_dtype, fp8, use_te, initialize)
        block_parallel = dataclasses.replace(parallel, pipeline=1, virtual_pipeline=1,
                                             pipeline_split=[])
        super().__init__(config=model_config)
        if parallel.virtual_pipeline > 1:
            self.vp_stage = stage // parallel.pipeline
        self.cfg, self.stages, self.stage = cfg, stages, this
        self.model_type = ModelType.encoder_or_decoder  # what megatron-core's schedules expect
        self.pre_process, self.post_process = this.embedding, this.head
        # Messages between stages have the stacked [stream; H_E] shape everywhere under the
        # interleaved schedule (one shape) once any of them carries H_E.
        self.padded_messages = parallel.virtual_pipeline > 1 and any(
            s.sends_encoding for s in stages)
        self.stage_input: torch.Tensor | None = None
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = cfg.tie_embeddings
        self.vocab_size = cfg.vocab_size
        self.max_sequence_length = cfg.seq_length

        if this.embedding:
            self.embedding = LanguageModelEmbedding(
                config=model_config, vocab_size=cfg.vocab_size, max_sequence_length=cfg.seq_length,
                position_embedding_type="rope",
            )
        self.rotary_pos_emb = RotaryEmbedding(
            kv_channels=cfg.kv_channels, rotary_percent=1.0, rotary_base=cfg.rotary_base,
            use_cpu_initialization=model_config.use_cpu_initialization,
        )
        self.encoder = self.decoder = None
        if this.held("encoder"):
            enc_config = transformer_config(cfg, block_parallel, enc_layers, cfg.ffn_hidden_size,
                                            params_dtype, fp8, use_te, initialize)
            self.encoder = LayerBlock(
                enc_config, specs.layer_spec(cfg, "plain", use_te, moe=cfg.moe_in("encoder")),
                this.held("encoder"))
        # The stage runs the last encoder layer (or, without an encoder, is the first stage): the
        # decoder's input and encoding originate here.
        self.encoding_starts_here = (this.start < enc_layers <= this.start + this.applications
                                     if enc_layers else this.start == 0)
        self._segments: list[Segment] = []
        if this.held("decoder"):
            dec_config = transformer_config(cfg, block_parallel, dec_layers,
                                            cfg.decoder_ffn_hidden_size, params_dtype, fp8, use_te,
                                            initialize)
            decoder_spec = specs.layer_spec(cfg, cfg.decoder_attention, use_te,
                                            moe=cfg.moe_in("decoder"), layer_offset=enc_layers)
            self.decoder = LayerBlock(dec_config, decoder_spec, this.held("decoder"))
            self._segments = [Segment(self.decoder.span(run.first, run.count), run.step,
                                      run.first == 1) for run in this.runs
                              if run.block == "decoder"]
            self._mark_tied_copies()
        if this.head:
            self.final_layernorm = build_module(specs.final_norm_spec(use_te), config=model_config,
                                                hidden_size=cfg.hidden_size, eps=cfg.norm_eps)
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                cfg.hidden_size, cfg.vocab_size, config=model_config,
                init_method=model_config.init_method, bias=False, skip_bias_add=False,
                gather_output=not parallel_output,
                skip_weight_param_allocation=this.embedding and cfg.tie_embeddings,
            )
        self.setup_embeddings_and_output_layer()
        self.routing_stats = self._attach_routing_stats(
            ([self.first_group] if enc_layers else [])
            + [f"{self.loop_group}{t}" for t in range(1, cfg.iterations + 1)])

    # ------------------------------------------------------------------ tied decoder copies
    def decoder_holders(self, layer: int) -> list[int]:
        """The stages holding decoder layer ``layer`` (1-based), ascending: more than one when the
        pipeline unrolls the loop over stages (tied copies); the first holds the primary copy."""
        return [s.index for s in self.stages if layer in s.held("decoder")]

    def is_primary_copy(self, layer: int) -> bool:
        return self.decoder_holders(layer)[0] == self.stage.index

    def _mark_tied_copies(self) -> None:
        """Marks the parameters of the decoder layers whose primary copy is on another stage
        ``shared`` (megatron-core's convention for a tied embedding's second copy): the gradient
        norm counts each tied parameter once."""
        for layer in self.decoder.layers:
            if not self.is_primary_copy(layer.layer_number):
                for param in layer.parameters():
                    param.shared = True

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None):
        """megatron-core's, with the tied decoder copies other than the primary one marked as
        replicas: every copy maps to the same key and a checkpoint holds one (saved by the primary
        holder; loading fills every copy, several on one rank under the interleaved schedule:
        megaloop.training.sharded_load)."""
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.decoder is None:
            return state
        for position, layer in enumerate(self.decoder.layers):
            if self.is_primary_copy(layer.layer_number):
                continue
            layer_prefix = f"{prefix}decoder.layers.{position}."
            for key, entry in state.items():
                if key.startswith(layer_prefix):
                    entry.replica_id = _replica_of_copy(entry.replica_id, self.stage.index)
        return state

    def train(self, mode: bool = True):
        """Also sets the mode of the decoder spans, which are not submodules."""
        super().train(mode)
        for segment in self._segments:
            segment.block.train(mode)
        return self

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

    def routing_padding(self, padding_mask: torch.Tensor | None,
                        input_ids: torch.Tensor) -> torch.Tensor | None:
        """The padding mask as megatron-core's MoE layers take it: bool [B, N], True at padding,
        this rank's share of the sequence under sequence parallelism; None for a dense model.
        The routers then leave padding out of the auxiliary losses, the routing statistics and
        the experts (LoopedRouter.routing)."""
        if padding_mask is None or not self.cfg.uses_moe:
            return None
        if padding_mask.shape != input_ids.shape:
            raise ValueError(f"padding_mask of shape {list(padding_mask.shape)}: must have the "
                             f"shape of input_ids, {list(input_ids.shape)}")
        padding_mask = padding_mask.to(device=input_ids.device, dtype=torch.bool)
        if self.config.sequence_parallel:  # the hidden states are split on the sequence too
            padding_mask = tensor_parallel.scatter_to_sequence_parallel_region(
                padding_mask.t().contiguous()).t()
        return padding_mask

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline schedules hand a non-first stage its input message here."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.stage_input = input_tensor

    def global_kv(self, encoder_output: torch.Tensor, rotary_pos_emb) -> list[tuple]:
        """(keys, values) of every decoder layer this stage holds, each [N, B, groups, head_dim].

        Under FP8 the projections run in megatron-core's FP8 context of the decoder's layers (its
        recipe and amax-reduction group), as every linear inside those layers does: they run
        outside the decoder block, and Transformer Engine computes a linear called outside any
        FP8 context in bf16. A no-op without FP8."""
        with fp8_utils.get_fp8_context(self.decoder.config):
            return [layer.self_attention.project_global_kv(encoder_output, rotary_pos_emb)
                    for layer in self.decoder.layers]

    @contextlib.contextmanager
    def _global_kv_context(self, encoding: torch.Tensor | None, rope: torch.Tensor):
        """Yields the decoder block's ``context`` for the loop. While the loop runs, each decoder
        layer holds its own Global KV projections and reads them (LoopedTransformerLayer.
        _global_kv_slice says why). Only megatron-core's full recomputation reads the context:
        it replays a layer on the arguments the block was called with, so there the context is
        the Global KV of every decoder layer stacked in one copy, [layers, 2 (keys, values), N,
        B, groups, head_dim]; elsewhere it is None, sparing a stack-sized copy per forward that
        would be held until the loop ends."""
        if not self.stage.global_kv:
            yield None
            return
        projections = self.global_kv(encoding, rope)
        context = None
        # megatron-core's condition for the checkpointed forward (TransformerBlock.forward).
        if self.decoder.config.recompute_granularity == "full" and self.decoder.training:
            context = torch.stack([t for kv in projections for t in kv])
            context = context.unflatten(0, (len(projections), 2))
        for layer, kv in zip(self.decoder.layers, projections, strict=True):
            layer.global_kv_projections = (context, layer.self_attention.loop_global_kv(*kv))
        try:
            yield context
        finally:
            for layer in self.decoder.layers:
                layer.global_kv_projections = None

    def loop(self, state: torch.Tensor, encoding: torch.Tensor | None, rope: torch.Tensor,
             steps: int, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """This stage's share of the weight-tied decoder iterations (all K without pipelining;
        Full Loop: the stack R times), after the Global KV. ``state``: the decoder state arriving
        (z_0 on the stage where the encoding originates); ``encoding``: H_E (AsymLoop), else the
        embedding output on the first stage, else None; ``padding_mask``: ``routing_padding``'s."""
        cfg = self.cfg
        additive = cfg.arch == "asymloop" and cfg.injection == "additive"
        segments = (self._segments if len(self.stages) > 1 else
                    [Segment(self.decoder, t) for t in range(1, steps + 1)])
        with self._global_kv_context(encoding, rope) as context:
            return run_segments(segments, encoding, state, additive=additive,
                                step_context=lambda t: self.applying(f"{self.loop_group}{t}"),
                                attention_mask=None, context=context, rotary_pos_emb=rope,
                                padding_mask=padding_mask)

    def _unpack(self, message: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(stream, H_E or None) of a message from the previous stage."""
        if self.stage.receives_encoding:
            stream, encoding = message.chunk(2, dim=0)
            return stream, encoding
        return (message.chunk(2, dim=0)[0] if self.padded_messages else message), None

    def _pack(self, stream: torch.Tensor, encoding: torch.Tensor | None) -> torch.Tensor:
        """The message to the next stage: the stream, [stream; H_E] once the encoding travels."""
        if self.stage.sends_encoding:
            return torch.cat([stream, encoding])
        return torch.cat([stream, torch.zeros_like(stream)]) if self.padded_messages else stream

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                num_iterations: int | None = None,
                padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Returns logits [B, N, V/tp] or, with ``labels``, per-token losses [B, N]; a stage
        without the head returns its message to the next stage.

        ``num_iterations`` overrides K (or R) for test-time depth scaling (one stage only: a
        pipeline unrolls exactly K). Attention is causal by construction; ``attention_mask`` is
        accepted for megatron-core's calling convention only. ``padding_mask`` [B, N] (True at
        padding: fine-tuning's right padding) keeps those positions out of MoE routing.
        """
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        steps = self.cfg.iterations if num_iterations is None else num_iterations
        problem = self.cfg.depth_refusal(steps)
        if problem:
            raise ValueError(f"num_iterations={steps}: {problem}")
        if len(self.stages) > 1 and steps != self.cfg.iterations:
            raise ValueError(f"num_iterations={steps}: a pipeline runs exactly the "
                             f"iterations={self.cfg.iterations} its stages unroll")
        if self.pre_process:
            state, encoding = self.embedding(input_ids=input_ids, position_ids=position_ids), None
        else:
            state, encoding = self._unpack(self.stage_input)
        # megatron-core moves RoPE's frequencies to the GPU at the first forward wherever there is
        # one; a model built on the CPU (build_device.built_on_cpu) takes its RoPE there.
        rope = self.rotary_pos_emb(input_ids.shape[1]).to(state.device)
        padding_mask = self.routing_padding(padding_mask, input_ids)
        if self.encoder is not None:
            with self.applying(self.first_group):
                state = self.encoder(state, attention_mask=None, rotary_pos_emb=rope,
                                     padding_mask=padding_mask)
        if self.encoding_starts_here:  # z_0 follows from the encoding (recurrence.run_segments)
            additive = self.cfg.arch == "asymloop" and self.cfg.injection == "additive"
            encoding, state = state, torch.zeros_like(state) if additive else state
        if self.decoder is not None:
            state = self.loop(state, encoding, rope, steps, padding_mask)
        if not self.post_process:
            return self._pack(state, encoding)
        hidden = self.final_layernorm(state)
        weight = self.shared_embedding_or_output_weight() if self.cfg.tie_embeddings else None
        logits, _ = self.output_layer(hidden, weight=weight)
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        return self.compute_language_model_loss(labels, logits)


def check_parallel_groups(parallel: ParallelConfig) -> None:
    """Refuses tensor/expert sizes other than those of megatron-core's process groups: its layers
    split by the groups, so a differing ``parallel`` would reach the config only (tensor=2 on
    TP=1 groups builds whole layers under a config saying TP=2). Pipeline sizes may differ: the
    model is the one ``stage`` asked for (tests chain all stages in one process)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return  # megatron-core's layers refuse to build without groups
    held = {"tensor": ps.get_tensor_model_parallel_world_size(),
            "expert": ps.get_expert_model_parallel_world_size()}
    for name, size in held.items():
        if getattr(parallel, name) != size:
            raise ValueError(f"parallel.{name}={getattr(parallel, name)}: megatron-core's "
                             f"{name}-parallel group has {size} rank(s); initialise the groups "
                             "with the same sizes (megaloop.platform.distributed.init_distributed)")


def note_fp32_joint_attention(cfg: ModelConfig, params_dtype: torch.dtype) -> None:
    """Logs the one case where joint_attention=fused runs another kernel (``runs_masked_formula``:
    fp32 on a GPU, where the exact masked formula runs). The model's tensors live on the GPU when
    there is one and carry ``params_dtype``."""
    device = torch.device("cuda" if builds_on_gpu() else "cpu")
    if (cfg.decoder_attention == "joint" and cfg.joint_attention == "fused"
            and runs_masked_formula(device, params_dtype)):
        log.warning("model.joint_attention='fused' in fp32 on CUDA runs the masked formula (the "
                    "CUDA flash kernel takes bf16/fp16 only): [N, 2N] attention scores per head")


def note_flash_core_attention_recompute(cfg: ModelConfig, parallel: ParallelConfig,
                                        params_dtype: torch.dtype) -> None:
    """Logs when selective recomputation of the core attention can save little: a flash kernel
    keeps no attention scores for its backward pass, only its output and log-sum-exps (and, in
    megaloop's local kernels, keys/values repeated to every head), so the replay spends the
    attention FLOPs again for little memory (megatron-core says as much for Transformer Engine's
    fused attention). Only the joint attention's masked formula keeps [N, 2N] probabilities."""
    if "core_attn" not in parallel.selective_modules:
        return
    device = torch.device("cuda" if builds_on_gpu() else "cpu")
    if cfg.decoder_attention == "joint" and (cfg.joint_attention == "masked"
                                             or runs_masked_formula(device, params_dtype)):
        return
    log.warning("parallel.recompute_modules: 'core_attn' replays flash-attention kernels, which "
                "keep no attention scores: little memory saved (their outputs and log-sum-exps at "
                "most) for the attention FLOPs again; it pays off where scores are kept "
                "(model.joint_attention=masked)")


def _replica_of_copy(replica_id, stage: int):
    """A checkpoint entry's replica id marked as the tied copy of ``stage`` (> 0, the primary
    copy's stage being lower): its first element, which megatron-core keeps for pipeline
    replicas (as for the tied output layer), becomes ``stage``."""
    if isinstance(replica_id, tuple):
        return (stage, *replica_id[1:])
    return (stage, 0, replica_id)


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
