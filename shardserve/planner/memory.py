"""What a model weighs: parameters (total and active, dense, MoE and MLA models), weight bytes per
rank for a TP/PP layout (MoE: experts sliced over TP, or whole over an expert-parallel group) and
dtype, KV-cache bytes per token, all from the HF config alone.

Every layer is described as a list of `Part`s (a weight matrix or a norm) with how tensor
parallelism shards it; per-rank bytes and bytes read per decode step both fall out of that list."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from shardserve.quantization.stored import head_quantized, weight_dtype

# Bytes per weight. int4 adds, per group of 128 weights (GPTQ/AWQ's usual group), the fp16 scale
# and uint8 zero point the CUDA kernels hold (kernels/quant/int4_layout.py).
# fp4: NVFP4's E2M1 values and an E4M3 scale per 16 (MXFP4's, one per 32, are fewer)
WEIGHT_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5 + 3 / 128,
                "fp4": 0.5 + 1 / 16}
KV_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
_DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
                  "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}


def norm_dtype(name: str) -> str:
    return _DTYPE_ALIASES.get(name.lower(), name.lower())


@dataclass(frozen=True)
class Part:
    params: int
    shard: str             # "split": 1/TP per rank; "kv": K/V heads (replicated when TP > kv heads); "rep": whole
    linear: bool = True    # a projection weight: stored in the weight dtype; norms, biases, routers stay 16-bit
    expert: bool = False   # a routed expert: a decode step reads only the experts its tokens picked


class ModelShape:
    """The sizing view of an HF config. Raises ValueError naming the key that is missing."""

    def __init__(self, config: dict[str, Any], linear_bytes: dict[str, float] | None = None,
                 embed_bytes: dict[str, float] | None = None, expert_bytes: dict[str, float] | None = None) -> None:
        c = self.config = config
        # Per dtype, bytes per weight of the (non-expert) linears, of the token embedding and of the
        # routed experts where they are not the dtype's: a GGUF file's, kept in blocks
        # (catalog.gguf_linear_bytes / _embedding_bytes / _expert_bytes). INT8 experts are widened to
        # 16 bits at load on GPUs (quantization/int8.Int8MoEMethod), FP4 ones dequantized (fp4_moe.py).
        self.linear_bytes = linear_bytes or {}
        self.embed_bytes = embed_bytes or {}
        self.expert_bytes = {"int8": 2.0, "fp4": 2.0, **(expert_bytes or {})}
        try:
            self.hidden, self.layers, self.heads = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]
            self.vocab = c["vocab_size"]
        except KeyError as e:
            raise ValueError(f"config has no {e.args[0]!r}: not a decoder-only transformer config") from None
        self.kv_heads = c.get("num_key_value_heads") or self.heads
        self.head_dim = c.get("head_dim") or self.hidden // self.heads
        self.tie = bool(c.get("tie_word_embeddings", False))
        # GPTQ's lm_head: true: the LM head is held like the linears (layers/vocab.py)
        self.head_quantized = head_quantized(c.get("quantization_config"))
        self.mla = "kv_lora_rank" in c
        self.experts = int(c.get("n_routed_experts") or c.get("num_local_experts") or c.get("num_experts") or 0)
        self.top_k = int(c.get("num_experts_per_tok") or 0)
        self.intermediate = int(c.get("intermediate_size") or 4 * self.hidden)
        self.moe_intermediate = int(c.get("moe_intermediate_size") or self.intermediate)
        self.shared_width = int((c.get("n_shared_experts") or 0) * self.moe_intermediate
                                or c.get("shared_expert_intermediate_size") or 0)
        self.moe_layers = tuple(self._is_moe_layer(i) for i in range(self.layers))
        self.max_position_embeddings = int(c.get("max_position_embeddings") or 4096)
        self._parts = [self._layer_parts(i) for i in range(self.layers)]
        self._cache: dict[tuple, list[float]] = {}

    # ---- structure -------------------------------------------------------------------------------
    def _is_moe_layer(self, i: int) -> bool:
        c = self.config
        if self.experts <= 1:
            return False
        if "n_routed_experts" in c:      # DeepSeek V2/V3: the first k layers stay dense
            return i >= c.get("first_k_dense_replace", 0) and i % c.get("moe_layer_freq", 1) == 0
        # Qwen2/3-MoE (whose config transformers 5 saves with num_local_experts, as Mixtral's); Mixtral
        # has neither key: every layer. The engine's rule (models/spec.py MoeSpec).
        return i not in (c.get("mlp_only_layers") or []) and (i + 1) % (c.get("decoder_sparse_step") or 1) == 0

    def _attention_parts(self) -> list[Part]:
        c, h = self.config, self.hidden
        if self.mla:
            rope, nope, v = c["qk_rope_head_dim"], c["qk_nope_head_dim"], c["v_head_dim"]
            q_lora, kv_lora = c.get("q_lora_rank"), c["kv_lora_rank"]
            # The low-rank down projections are replicated on every TP rank; the up projections split by head.
            q_up = self.heads * (nope + rope)
            q = ([Part(h * q_lora, "rep"), Part(q_lora, "rep", False), Part(q_lora * q_up, "split")]
                 if q_lora else [Part(h * q_up, "split")])
            return q + [Part(h * (kv_lora + rope), "rep"), Part(kv_lora, "rep", False),
                        Part(kv_lora * self.heads * (nope + v), "split"), Part(self.heads * v * h, "split")]
        hd, arch = self.head_dim, (c.get("architectures") or [""])[0]
        qkv_bias = c.get("attention_bias", arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"))
        o_bias = bool(c.get("attention_bias", False)) and arch == "LlamaForCausalLM"
        parts = [Part(h * self.heads * hd, "split"), Part(2 * h * self.kv_heads * hd, "kv"),
                 Part(self.heads * hd * h, "split")]
        if qkv_bias:
            parts += [Part(self.heads * hd, "split", False), Part(2 * self.kv_heads * hd, "kv", False)]
        if o_bias:
            parts.append(Part(h, "rep", False))
        if c.get("model_type") in ("qwen3", "qwen3_moe"):   # per-head q/k RMSNorm
            parts.append(Part(2 * hd, "rep", False))
        return parts

    def _layer_parts(self, i: int) -> list[Part]:
        c, h = self.config, self.hidden
        parts = self._attention_parts() + [Part(2 * h, "rep", False)]   # the two RMSNorms
        if not self.moe_layers[i]:
            return parts + [Part(3 * h * self.intermediate, "split")]
        parts += [Part(self.experts * 3 * h * self.moe_intermediate, "split", expert=True),
                  Part(self.experts * h, "rep", False)]                  # router
        if c.get("topk_method") == "noaux_tc":
            parts.append(Part(self.experts, "rep", False))               # DeepSeek-V3's routing bias
        if self.shared_width:
            parts.append(Part(3 * h * self.shared_width, "split"))
        if c.get("shared_expert_intermediate_size"):
            parts.append(Part(h, "rep", False))                          # Qwen2-MoE's shared-expert gate
        return parts

    # ---- parameter counts -----------------------------------------------------------------------
    def param_counts(self) -> dict[str, int]:
        """total, active (per token: top-k experts), per-layer, embeddings and LM head."""
        layer = [sum(p.params for p in parts) for parts in self._parts]
        embed = self.vocab * self.hidden
        head = 0 if self.tie else embed
        active_layers = sum(sum(p.params * (self.top_k / self.experts if p.expert else 1) for p in parts)
                            for parts in self._parts)
        expert = sum(p.params for parts in self._parts for p in parts if p.expert)
        total = sum(layer) + embed + head + self.hidden
        return {"per_layer": sum(layer) // self.layers, "layers": sum(layer), "embed": embed, "lm_head": head,
                "experts": expert, "total": total,
                "active": int(round(active_layers)) + embed + head + self.hidden}

    # ---- bytes per rank --------------------------------------------------------------------------
    def _share(self, part: Part, tp: int, ep: int = 1) -> float:
        if part.expert and ep > 1:  # expert parallel: EP ranks hold experts / EP whole experts each
            return 1 / ep
        if part.shard == "split":
            return 1 / tp
        if part.shard == "kv":     # each rank keeps max(kv/tp, 1) heads: replicated when TP > kv heads
            return max(self.kv_heads // tp, 1) / self.kv_heads
        return 1.0

    def _layer_bytes(self, dtype: str, tp: int, picked: float, ep: int) -> list[float]:
        """Prefix sums of one rank's bytes per layer (cached: the planner asks for many layouts)."""
        key = (dtype, tp, picked, ep)
        if key not in self._cache:
            wb = WEIGHT_BYTES[dtype]
            other = wb if dtype in ("fp32", "bf16", "fp16") else 2.0
            linear, expert = self.linear_bytes.get(dtype, wb), self.expert_bytes.get(dtype, wb)
            sums = [0.0]
            for parts in self._parts:
                sums.append(sums[-1] + sum(p.params * self._share(p, tp, ep) * (picked if p.expert else 1.0)
                                           * ((expert if p.expert else linear) if p.linear else other) for p in parts))
            self._cache[key] = sums
        return self._cache[key]

    def weight_bytes(self, dtype: str, tp: int, layers: range, first: bool, last: bool,
                     batch: int | None = None, ep: int = 1) -> float:
        """Bytes one TP rank holds for `layers` (first stage: embeddings; last: final norm + LM head).
        ep > 1: routed experts split whole over `ep` ranks (experts / ep each), not sliced over TP.
        With `batch`, the bytes one decode step reads instead when the rank's experts see `batch`
        tokens: routed experts count by the expected number picked (of the E/EP a rank holds, or of
        every slice), and the embedding table is looked up, not read."""
        picked = 1.0
        if batch is not None and self.experts:
            # Expected share of experts hit by `batch` tokens each picking top_k of E uniformly.
            picked = 1 - (1 - self.top_k / self.experts) ** batch
        sums = self._layer_bytes(dtype, tp, picked, ep)
        total = sums[layers.stop] - sums[layers.start]
        other = WEIGHT_BYTES[dtype] if dtype in ("fp32", "bf16", "fp16") else 2.0
        rows = math.ceil(self.vocab / tp) * self.hidden        # vocab-parallel, padded to equal slices
        if first and batch is None and not (self.tie and last):   # tied: one table serves both ends
            total += rows * self.embed_bytes.get(dtype, other)
        if last:
            head = self.linear_bytes.get(dtype, WEIGHT_BYTES[dtype]) if self.head_quantized else other
            total += rows * head + self.hidden * other
        return total

    # ---- KV cache --------------------------------------------------------------------------------
    def kv_bytes_per_token_layer(self, kv_dtype: str, tp: int = 1) -> float:
        b = KV_BYTES[kv_dtype]
        if self.mla:
            # MLA caches one latent (kv_lora_rank) plus the shared rotary key (qk_rope_head_dim) per
            # token and layer, not 2 x heads x head_dim; every TP rank keeps the whole latent.
            return (self.config["kv_lora_rank"] + self.config["qk_rope_head_dim"]) * b
        heads = self.kv_heads // tp if tp <= self.kv_heads else 1
        return 2 * heads * self.head_dim * b

    def kv_bytes_per_token(self, kv_dtype: str, tp: int = 1, layers: int | None = None) -> float:
        return self.kv_bytes_per_token_layer(kv_dtype, tp) * (self.layers if layers is None else layers)

    # ---- tensor-parallel sizes that work ---------------------------------------------------------
    def tp_problem(self, tp: int, ep: int = 1) -> str | None:
        """Why TP=`tp` (with experts whole over `ep` ranks when ep > 1) cannot shard this model, or None."""
        if self.heads % tp:
            return f"TP={tp} does not divide the {self.heads} attention heads"
        if not self.mla and self.kv_heads % tp and tp % self.kv_heads:
            return f"TP={tp} and the {self.kv_heads} KV heads do not divide one another"
        if not all(self.moe_layers) and self.intermediate % tp:
            return f"TP={tp} does not divide the MLP width {self.intermediate}"
        if any(self.moe_layers) and ep > 1:
            if self.experts % ep:
                return f"EP={ep} does not divide the {self.experts} experts"
            if self.shared_width % tp:
                return f"TP={tp} does not divide the shared-expert width {self.shared_width}"
        elif any(self.moe_layers) and self.moe_intermediate % tp:
            return f"TP={tp} does not divide the expert MLP width {self.moe_intermediate}"
        return None


def config_dtype(config: dict[str, Any]) -> str:
    """The dtype a checkpoint's weights are stored in: its quantization, else torch_dtype."""
    stored = weight_dtype(config.get("quantization_config"))
    if stored:
        return stored
    name = norm_dtype(str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"))
    return "bf16" if name == "fp32" else name   # served in 16 bits, as the engine does on GPUs
