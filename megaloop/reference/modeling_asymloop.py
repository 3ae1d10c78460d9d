"""Plain-PyTorch reference of megaloop's models (Dense, Full Loop, AsymLoop), independent of
megatron-core, and their Hugging Face model.

This file imports only torch and transformers so that it ships as self-contained Hugging Face
modeling code (``trust_remote_code``). It is the second of the project's two model definitions;
parity tests hold it to the canonical megatron-core model (logits and gradients to 1e-5 in fp32
given the same weights). Attention is the exact masked softmax, written for clarity.

Model (L physical layers, E encoder layers, D = L - E decoder layers, K iterations):
    H_E = Enc(Embed(x))                                # once
    G_l = (k_norm(Wgk_l RMSNorm_l(H_E)), Wgv_l RMSNorm_l(H_E))   # once per decoder layer l
    z_0 = H_E;  z_t = Dec(z_{t-1}; G), t = 1..K        # weight-tied decoder
    logits = Head(FinalNorm(z_K))
Dense is E = 0, D = L, K = 1; Full Loop is E = 0, D = L, K = R. H_E enters the decoder un-normalised
(the residual stream continues); only the Global KV projections see it through a per-layer RMSNorm.

Generation (``LoopedCache``): the encoder runs once per new token with one KV slot per encoder
layer; the Global KV has one slot per decoder layer, extended by the new tokens' projections; the
Local KV has one slot per (iteration, decoder layer). A forward over new tokens attends to
everything cached before them, so a prompt fed in chunks gives the logits of one full forward.
"""

from __future__ import annotations

import copy
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_megaloop import MODEL_FIELDS, MegaloopConfig
from .modeling_moe import MLP, MoEFeedForward

# What transformers calls the cache, in outputs and generate() arguments: ``cache`` since 5.24,
# ``past_key_values`` before (e.g. ``generate(..., **{CACHE_ARGUMENT: model.new_cache()})``).
CACHE_ARGUMENT = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ \
    else "past_key_values"


def attend(q, blocks, allowed, scale):
    """Softmax attention of q [B, H, Nq, D] over key/value blocks [(k, v)] (each [B, H, Nk, D])
    under one softmax; ``allowed`` [B or 1, 1, Nq, Nk] (None: every key) masks every block alike.
    The blocks' scores are joined, not their keys and values: a [Global; Local] attention copies
    no cached tensor."""
    scores = [(q @ k.transpose(-1, -2)) * scale for k, _ in blocks]
    if allowed is not None:
        scores = [s.masked_fill(~allowed, float("-inf")) for s in scores]
    if len(blocks) == 1:
        return scores[0].softmax(-1) @ blocks[0][1]
    weights = torch.cat(scores, dim=-1).softmax(-1).split([s.shape[-1] for s in scores], dim=-1)
    return sum(w @ v for w, (_, v) in zip(weights, blocks))


def causal_mask(n_queries, n_keys, device, key_valid=None):
    """[B or 1, 1, Nq, Nk]: the new queries are the last Nq of Nk positions; query i sees keys up to
    its own position. ``key_valid`` [B, Nk] hides padding keys (a padding query sees itself, so
    that no softmax row is empty). None when nothing is hidden: one new query sees every key."""
    if n_queries == 1 and key_valid is None:
        return None
    query_index = torch.arange(n_keys - n_queries, n_keys, device=device)[:, None]
    key_index = torch.arange(n_keys, device=device)[None]
    allowed = key_index <= query_index
    if key_valid is None:
        return allowed[None, None]
    return (allowed & (key_valid[:, None, :] | (key_index == query_index)))[:, None]


def joint_attention(q, k_glob, v_glob, k_loc, v_loc, scale):
    """One softmax over [Global; Local] keys; query i sees Global <= i and Local <= i.
    All [B, H, N, D]; megaloop's masked joint-attention kernel."""
    allowed = causal_mask(q.shape[-2], k_loc.shape[-2], q.device)
    return attend(q, [(k_glob, v_glob), (k_loc, v_loc)], allowed, scale)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rope(positions, head_dim, base):
    """(cos, sin) [B, 1, N, head_dim] for integer positions [B, N]."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                            device=positions.device) / head_dim))
    angles = positions[..., None].float() * inv_freq
    angles = torch.cat([angles, angles], dim=-1)[:, None]
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # fp32 tables would promote bf16 activations
    return x * cos + rotate_half(x) * sin


class LoopedCache(DynamicCache):
    """KV cache of a looped model: one transformers cache layer per *slot*, a (layer, iteration)
    pair or a Global KV layer, so one physical layer owns several slots. ``seen`` counts the tokens
    consumed; ``state`` holds batch-first tensors beyond keys/values (padding of the cached
    positions, LatentLoop's pending tokens and latent updates), reordered with the keys by beam
    search. A cache is tied to one number of iterations: the one it was made for, else (None)
    that of its first call."""

    def __init__(self, iterations: int | None = None):
        super().__init__()
        self.iterations = iterations
        self.seen = 0
        self.state: dict[str, torch.Tensor] = {}

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.state = {k: v.index_select(0, beam_idx.to(v.device)) for k, v in self.state.items()}

    def crop(self, tokens_to_remove: int) -> None:
        """Drops the last ``-tokens_to_remove`` tokens (as transformers 5.24 passes it; before, a
        positive value is the number of tokens to keep): assisted decoding and prompt lookup drop
        the draft tokens the model rejected. A LatentLoop cache with compressed visits holds
        latents of k tokens and their pending inputs, which do not drop tokens: a ValueError saying
        so (the slots and ``seen`` would disagree)."""
        if tokens_to_remove == 0:
            return
        latent = sorted(name for name in self.state if name != "valid")
        if latent:
            raise ValueError(f"this cache cannot drop tokens: it holds LatentLoop state ({latent[0]}"
                             ", latents of k tokens); decode without assisted decoding or prompt "
                             "lookup")
        super().crop(tokens_to_remove)
        self.seen = min(tokens_to_remove, self.seen) if tokens_to_remove > 0 else \
            max(self.seen + tokens_to_remove, 0)
        if "valid" in self.state:
            self.state["valid"] = self.state["valid"][:, :self.seen]


class Attention(nn.Module):
    def __init__(self, cfg: MegaloopConfig, global_kv: bool, local_kv: bool):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.heads, self.groups, self.head_dim = cfg.num_attention_heads, cfg.num_query_groups, hd
        self.local_kv = local_kv
        self.q_proj = nn.Linear(d, self.heads * hd, bias=False)
        if local_kv:
            self.k_proj = nn.Linear(d, self.groups * hd, bias=False)
            self.v_proj = nn.Linear(d, self.groups * hd, bias=False)
        self.o_proj = nn.Linear(self.heads * hd, d, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(hd, eps=cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        if global_kv:
            self.global_norm = nn.RMSNorm(d, eps=cfg.norm_eps) if cfg.global_kv_norm else nn.Identity()
            self.global_k_proj = nn.Linear(d, self.groups * hd, bias=False)
            self.global_v_proj = nn.Linear(d, self.groups * hd, bias=False)

    def _heads(self, x, n_heads):
        b, n, _ = x.shape
        return x.view(b, n, n_heads, self.head_dim).transpose(1, 2)

    def _expand(self, kv):  # grouped-query attention: each kv head serves heads/groups queries
        return kv if self.heads == self.groups else kv.repeat_interleave(self.heads // self.groups,
                                                                         dim=1)

    def _cached(self, k, v, cache, slot):
        return (k, v) if cache is None else cache.update(k, v, slot)

    def global_kv(self, h_enc, rotary, cache=None, slot=None):
        """This layer's Global keys (rotated: key j sits at position j) and values from the encoder
        output, after those of the cached positions; expanded to the query heads once, for all
        iterations."""
        x = self.global_norm(h_enc)
        k = apply_rope(self.k_norm(self._heads(self.global_k_proj(x), self.groups)), *rotary)
        k, v = self._cached(k, self._heads(self.global_v_proj(x), self.groups), cache, slot)
        return self._expand(k), self._expand(v)

    def forward(self, x, rotary, allowed, cache=None, slot=None, global_kv=None):
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x), self.heads)), *rotary)
        blocks = [global_kv] if global_kv is not None else []
        if self.local_kv:
            k = apply_rope(self.k_norm(self._heads(self.k_proj(x), self.groups)), *rotary)
            k, v = self._cached(k, self._heads(self.v_proj(x), self.groups), cache, slot)
            blocks.append((self._expand(k), self._expand(v)))
        out = attend(q, blocks, allowed, 1.0 / math.sqrt(self.head_dim))
        b, _, n, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm over as many channels as its weight has, so that a call with a leading part of
    the weight (LatentLoop's width reduction, through torch.func.functional_call) normalises that
    many channels."""

    def forward(self, x):
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Block(nn.Module):
    def __init__(self, cfg: MegaloopConfig, ffn: int, global_kv: bool = False,
                 local_kv: bool = True, moe: bool = False):
        super().__init__()
        self.post_norm = cfg.block == "olmo"
        self.attn_norm = RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp_norm = RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = Attention(cfg, global_kv, local_kv)
        self.mlp = MLP(cfg.hidden_size, ffn) if not moe else MoEFeedForward(
            cfg.hidden_size, cfg.num_experts, cfg.moe_top_k, cfg.moe_ffn_hidden_size,
            cfg.moe_shared_expert_size)

    def forward(self, h, rotary, allowed, cache=None, slot=None, global_kv=None):
        if self.post_norm:  # OLMo 2: h + Norm(Attn(h)), then h + Norm(MLP(h))
            h = h + self.attn_norm(self.attn(h, rotary, allowed, cache, slot, global_kv))
            return h + self.mlp_norm(self.mlp(h))
        h = h + self.attn(self.attn_norm(h), rotary, allowed, cache, slot, global_kv)
        return h + self.mlp(self.mlp_norm(h))


class MegaloopPreTrainedModel(PreTrainedModel):
    """What megaloop's Hugging Face models share: embedding and head, the cache, padding and
    positions, the output. Subclasses implement ``body`` (embedded tokens -> final hidden states)."""

    config_class = MegaloopConfig
    base_model_prefix = "megaloop"
    _no_split_modules = ["Block"]
    _tied_weights_keys = {"lm_head.weight": "embed_tokens.weight"}

    def _build_embeddings(self, cfg: MegaloopConfig) -> None:
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def post_init(self):
        super().post_init()
        # The config the modules were built from: a field edited later (model.config.x = v) is
        # applied or refused at the next forward (``_apply_config_edits``), not run past.
        self._built_config = copy.deepcopy(self.config)

    def _apply_config_edits(self) -> None:
        """Each field of ``self.config`` a user changed since the model was built, applied as
        ``from_pretrained(dir, name=value)`` would have (the modules that hold ``norm_eps``,
        ``moe_top_k`` or fixed residual scales take the new value; ``iterations``, ``rotary_base``
        and ``max_position_embeddings`` are read at each call) or a one-line ValueError naming it
        where from_pretrained refuses it: another architecture field would run another model on
        these weights, or (``qk_norm``, a LatentLoop's ``iterations``) fail or be ignored."""
        built = self._built_config
        # (read from the instances' dicts: PretrainedConfig's getattr costs a forward 0.1 ms)
        now, then = vars(self.config), vars(built)
        for name in MODEL_FIELDS:
            value, was = now[name], then[name]
            if value == was or (isinstance(was, list) and isinstance(value, (list, tuple)) and (
                    sorted(value) == sorted(was) if name == "latent_visits" else
                    list(value) == was)):
                continue
            if name == "vocab_size" and value == self.embed_tokens.num_embeddings:
                built.vocab_size = value  # resize_token_embeddings sets it
                continue
            problem = built.load_time_refusal(name, value)
            if problem:
                raise ValueError(f"model.config.{name}={value!r} (changed after loading; the model "
                                 f"was built with {was!r}): {problem}")
            for module in self.modules():
                if name == "norm_eps" and isinstance(module, nn.RMSNorm):
                    module.eps = value
                elif name == "moe_top_k" and isinstance(module, MoEFeedForward):
                    module.top_k = value
            if name == "residual_scale_init":
                self._set_fixed_scales(value)
            setattr(built, name, copy.deepcopy(value))

    def _set_fixed_scales(self, value) -> None:
        """LatentLoop's fixed residual scales set to ``value`` (a model without them: none)."""

    def save_pretrained(self, *args, **kwargs):
        """As PreTrainedModel's, after the config edits are applied or refused: a refused one
        would write a config.json that builds another model around the saved weights."""
        self._apply_config_edits()
        return super().save_pretrained(*args, **kwargs)

    def get_input_embeddings(self):
        return self.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model makes its own LoopedCache (generate would make a DynamicCache)

    def new_cache(self, num_iterations: int | None = None) -> LoopedCache:
        """An empty cache for ``num_iterations`` (None: the depth of its first call), e.g. for
        ``generate(..., cache=model.new_cache())``; a call at another depth is refused."""
        return LoopedCache(num_iterations)

    def generate(self, *args, **kwargs):
        """GenerationMixin.generate, given a new cache for assisted decoding, prompt lookup and
        chunked prefill (``prefill_chunk_size``): they use a cache passed in, and generate() makes
        none for a model with its own (``_supports_default_dynamic_cache``), so it refused them
        ("Assisted decoding requires a cache", "Cannot use prefill chunking without a cache")."""
        config = kwargs.get("generation_config") or self.generation_config
        needs_cache = any(kwargs.get(name, getattr(config, name, None)) is not None for name in
                          ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit",
                           "prefill_chunk_size"))
        # (5.24 still takes a cache under the old name, past_key_values)
        if needs_cache and kwargs.get("cache") is None and kwargs.get("past_key_values") is None:
            kwargs[CACHE_ARGUMENT] = self.new_cache()  # an empty one takes the call's depth
        return super().generate(*args, **kwargs)

    def _validate_generated_length(self, generation_config, input_ids_length, *args, **kwargs):
        """As generate() checks the lengths, a warning where the prompt and the tokens to generate
        run past ``max_position_embeddings``, the context the model was trained on, before it
        generates anything. The positions past it are RoPE's, defined but never trained:
        megaloop's own decoding (megaloop.generation) refuses them; here a warning, as Hugging
        Face models go on past their context, and a padded prompt's rows (padding counted in its
        length) may all stay within it. (transformers' own "friendly reminder" comes once per
        process, after the tokens past the context.) A private method of GenerationMixin's: no
        public hook sees the max_length generate() resolves before its first token; a test
        fails by name where the installed transformers renames or drops it."""
        super()._validate_generated_length(generation_config, input_ids_length, *args, **kwargs)
        context, total = self.config.max_position_embeddings, generation_config.max_length
        if total is not None and total > context:
            warnings.warn(f"a prompt of {input_ids_length} tokens (padding included) and up to "
                          f"{total - input_ids_length} new tokens run past the model's {context}-"
                          "token context (max_position_embeddings, the length it was trained on): "
                          "the tokens "
                          "past it are untrained extrapolation; generate at most "
                          f"{max(context - input_ids_length, 0)} new tokens", UserWarning,
                          stacklevel=3)

    def _positions(self, input_ids, attention_mask, cache):
        """RoPE positions [B, N] of the new tokens, the attention mask [B|1, 1, N, past + N] and the
        padding of all positions ([B, past + N] bool, None without padding). ``attention_mask``
        (1 = token, 0 = padding) covers the new tokens, or the cached and new ones.

        Left padding is read from the mask of a cache's first tokens (the prompt) only: once a
        cache holds tokens and no padding, its later calls' new tokens follow tokens (generate()
        extends the mask with ones), so their mask is not read back from the device, which on a
        GPU would be a sync at every generated token."""
        b, n = input_ids.shape
        past, device = (cache.seen if cache is not None else 0), input_ids.device
        past_valid = cache.state.get("valid") if cache is not None else None
        new_valid = None
        if attention_mask is not None:
            if attention_mask.shape[-1] not in (n, past + n):
                raise ValueError(f"attention_mask has {attention_mask.shape[-1]} positions: expected "
                                 f"{n} (the new tokens) or {past + n} (cached and new)")
            new_valid = attention_mask[:, -n:].bool()
            if past_valid is None and (past > 0 or bool(new_valid.all())):
                new_valid = None
        if past_valid is None and new_valid is None:
            positions = torch.arange(past, past + n, device=device)[None].expand(b, n)
            return positions, causal_mask(n, past + n, device), None
        if past_valid is None:
            past_valid = torch.ones(b, past, dtype=torch.bool, device=device)
        if new_valid is None:
            new_valid = torch.ones(b, n, dtype=torch.bool, device=device)
        valid = torch.cat([past_valid, new_valid], dim=1)
        positions = (past_valid.sum(1, keepdim=True) + new_valid.cumsum(1) - 1).clamp(min=0)
        return positions, causal_mask(n, past + n, device, valid), valid

    def forward(self, input_ids, attention_mask=None, cache=None, use_cache=None, labels=None,
                num_iterations=None, logits_to_keep=0, return_dict=None, past_key_values=None,
                inputs_embeds=None, num_items_in_batch=None, output_hidden_states=None,
                output_attentions=None, **generate_extras):
        """Logits [B, N, V] of ``input_ids`` after the cached tokens, the cache (with ``use_cache``)
        and, with ``labels`` ([B, N], -100 ignored), the next-token cross-entropy: the mean over
        the predicted tokens, or their sum over ``num_items_in_batch`` (the predicted tokens of all
        the micro-batches of a step, which transformers' Trainer passes under gradient
        accumulation). ``num_iterations`` overrides the configured iterations for this call.
        transformers before 5.24 passes the cache as ``past_key_values``, ``inputs_embeds=None``
        and the new tokens' positions as ``cache_position`` (the cache knows them: not needed).
        That one is taken unnamed: generate() of 5.24 warns about remote code whose forward names
        it (and makes it, for nothing). generate() also passes on its ``tokenizer`` (given for
        ``stop_strings``), which only its stopping criteria use.

        ``output_hidden_states`` (else ``config.output_hidden_states``) returns the new tokens'
        residual stream ``hidden_states`` as the model unrolls it (``body``): the embeddings, then
        the output of each layer each time it runs (every iteration's), the last one after the
        final norm, as transformers' models give it (what the head reads). ``output_attentions``
        is refused: the attention weights are not kept (one softmax over joined [Global; Local]
        blocks, latents in LatentLoop's compressed visits), and a silent None would pass for them."""
        unexpected = sorted(set(generate_extras) - {"cache_position", "tokenizer"})
        if unexpected:
            raise TypeError(f"forward() got an unexpected keyword argument {unexpected[0]!r}")
        if inputs_embeds is not None:
            raise ValueError("inputs_embeds: not supported, pass input_ids")
        self._apply_config_edits()
        cfg = self.config
        output_hidden_states = self._output_flag("output_hidden_states", output_hidden_states)
        self._output_flag("output_attentions", output_attentions)
        return_dict = self._output_flag("return_dict", return_dict)
        steps = cfg.iterations if num_iterations is None else num_iterations
        if isinstance(steps, bool) or not isinstance(steps, int):  # (range() would say it, deep)
            raise ValueError(f"num_iterations={steps!r}: must be an integer")
        if steps < 1:
            raise ValueError(f"num_iterations={steps}: must be >= 1")
        if cfg.arch == "dense" and steps != 1:  # as the canonical model refuses it
            raise ValueError(f"num_iterations={steps}: arch=dense has no depth to vary (it would "
                             "loop its layers; arch=fullloop is the looped stack)")
        cache = cache if cache is not None else past_key_values
        if cache is None and (cfg.use_cache if use_cache is None else use_cache):
            cache = self.new_cache(steps)
        if cache is not None:
            if not isinstance(cache, LoopedCache):
                raise ValueError(f"cache is a {type(cache).__name__}: pass None or "
                                 "model.new_cache() (a looped model has one slot per iteration)")
            if cache.iterations is None:  # model.new_cache(): the depth of its first call
                cache.iterations = steps
            if cache.iterations != steps:  # (empty, made for another depth: model.new_cache(n))
                raise ValueError(f"the cache was {'filled with' if cache.seen else 'made for'} "
                                 f"{cache.iterations} iterations; this call runs {steps} (start a "
                                 "new cache for another depth)")
        positions, allowed, valid = self._positions(input_ids, attention_mask, cache)
        states = [] if output_hidden_states else None
        hidden = self.body(self.embed_tokens(input_ids), positions, allowed, valid, cache, steps,
                           states)
        if cache is not None:
            cache.seen += input_ids.shape[1]
            if valid is not None:
                cache.state["valid"] = valid
        if states is None:
            logits = self.lm_head(self.norm(hidden[:, -logits_to_keep:]))
        else:  # (the last state is ``hidden``, the last layer's output)
            states[-1] = self.norm(hidden)
            logits = self.lm_head(states[-1][:, -logits_to_keep:])
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                   ignore_index=-100,
                                   reduction="mean" if num_items_in_batch is None else "sum")
            if num_items_in_batch is not None:
                loss = loss / torch.as_tensor(num_items_in_batch, device=loss.device)
            if self.training and torch.is_grad_enabled():
                self._note_router_losses_left_out()
        out = CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_ARGUMENT: cache},
                                     hidden_states=None if states is None else tuple(states))
        return out if return_dict else out.to_tuple()

    def _output_flag(self, name: str, value):
        """Forward's ``value`` of an output flag, else (None) the config's, as transformers'
        models take them; a one-line ValueError naming where a refused value came from:
        ``output_attentions`` (no weights kept) or an ``output_hidden_states`` other than a bool
        (transformers 5.25 selects them by index too)."""
        source = name if value is not None else f"model.config.{name}"
        value = value if value is not None else getattr(self.config, name)
        if name == "output_attentions" and value:
            raise ValueError(f"{source}={value!r}: not supported, this model keeps no attention "
                             "weights (output_hidden_states=True gives each layer's hidden states, "
                             "every iteration's)")
        if name == "output_hidden_states" and value is not None and not isinstance(value, bool):
            raise ValueError(f"{source}={value!r}: pass True or False (this model returns all its "
                             "hidden states)")
        return bool(value) if name != "return_dict" else value is not False

    def _note_router_losses_left_out(self) -> None:
        """One warning per model, on its first training loss: the config's router loss
        coefficients (carried for megaloop, module docstring of configuration_megaloop) are not
        applied here, so a fine-tuning (transformers' Trainer) went without them, unsaid."""
        cfg = self.config
        given = [f"{name}={getattr(cfg, name):g}" for name in ("moe_aux_loss_coeff",
                                                              "moe_z_loss_coeff")
                 if getattr(cfg, name)]
        if not cfg.num_experts or not given or getattr(self, "_router_losses_noted", False):
            return
        self._router_losses_noted = True
        warnings.warn(f"{', '.join(given)} (config.json): this model's loss is the cross-entropy "
                      "alone, so training it here leaves the routers' load-balancing and z-losses "
                      "out (megaloop's training applies them: tools/convert_checkpoint.py "
                      "from-hf, then checkpoint.load)", stacklevel=3)

    def _init_weights(self, module):
        """Fresh weights (transformers' init functions leave loaded tensors alone)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, std=self.config.initializer_range)
        elif isinstance(module, nn.RMSNorm):
            init.ones_(module.weight)


class LoopedLM(MegaloopPreTrainedModel, GenerationMixin):
    """Dense, Full Loop and AsymLoop (every ablation), as ``AutoModelForCausalLM``."""

    def __init__(self, cfg: MegaloopConfig):
        super().__init__(cfg)
        e = cfg.num_encoder_layers
        use_global = cfg.arch == "asymloop" and cfg.injection == "global_kv"
        moe = {part: cfg.num_experts > 0 and cfg.moe_layers in ("all", part)
               for part in ("encoder", "decoder")}
        self._build_embeddings(cfg)
        self.encoder = nn.ModuleList(Block(cfg, cfg.ffn_hidden_size, moe=moe["encoder"])
                                     for _ in range(e))
        self.decoder = nn.ModuleList(
            Block(cfg, cfg.decoder_ffn_hidden_size, use_global, cfg.local_kv or not use_global,
                  moe["decoder"])
            for _ in range(cfg.num_layers - e)
        )
        self.post_init()

    def body(self, h, positions, allowed, valid, cache, steps, states=None):
        """Slots: encoder layer e -> e; Global KV of decoder layer l -> E + l; Local KV of
        iteration t (0-based), layer l -> E + D + t * D + l. ``states`` (a list, or None) receives
        the embeddings and each layer's output: 1 + E + K * D tensors [B, N, d]."""
        cfg = self.config
        e, d = len(self.encoder), len(self.decoder)
        keep = states.append if states is not None else lambda _: None
        keep(h)
        rotary = rope(positions, cfg.head_dim, cfg.rotary_base)
        for index, block in enumerate(self.encoder):
            h = block(h, rotary, allowed, cache, index)
            keep(h)
        global_kvs = [None] * d
        if cfg.arch == "asymloop" and cfg.injection == "global_kv":
            global_kvs = [block.attn.global_kv(h, rotary, cache, e + index)
                          for index, block in enumerate(self.decoder)]
        additive = cfg.arch == "asymloop" and cfg.injection == "additive"
        z = torch.zeros_like(h) if additive else h
        for t in range(steps):
            if additive:
                z = z + h
            for index, (block, gkv) in enumerate(zip(self.decoder, global_kvs)):
                z = block(z, rotary, allowed, cache, e + d + t * d + index, gkv)
                keep(z)
        return z
