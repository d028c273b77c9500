"""A DeepSeek-V3.2-shaped (NSA / DSA attention) tiny model between two real SGLang 0.5.12
servers with HiCache and this plugin: migrate a prefix, compare greedy output.

The shape is V3.2's attention at TP 1 (128 heads, q LoRA 1536, kv LoRA 512 + rope 64,
indexer 64 heads x 128 dims, top-k 2048) on two dense layers with dummy weights; the
MoE fields are set only because SGLang reads them at start-up (`first_k_dense_replace`
= all layers: no MoE layer). For such a model SGLang picks `--attention-backend nsa`,
page size 64 and, on an H200 (SM90) with a bf16 KV cache, the `flashmla_sparse` prefill
and `fa3` decode kernels; the GPU recipe's trimmed sglang-kernel wheel drops FlashMLA
and FA3 (`../shared/gpu/README.md`). So the test first records which of the kernel
modules NSA reaches for import here, and a server that does not start fails the test
with its log's tail: the run itself says what is missing.

The prompt is longer than `index_topk` so the target's prefill of the last token reads
the migrated prefix through the sparse (indexer-selected) path; the indexer's keys live
in the KV pool beside the latent cache and must move with it for the output to match.
"""

from __future__ import annotations

import importlib
import os
import random
import sys
from pathlib import Path

import pytest
from sglang_kv_migration.client.migration import MigrationClient

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_servers import (  # noqa: E402
    ServerSpec,
    cached_details,
    cached_tokens,
    generate,
    record,
    running_servers,
    write_model,
)

pytestmark = pytest.mark.gpu

PORT_BASE = int(os.environ.get("KVMIG_PORT_BASE", "30800"))
NSA_PAGE_SIZE = 64  # SGLang forces it for DeepSeek DSA on CUDA
PROMPT_TOKENS = 3000  # > index_topk: the sparse path runs

TINY_DEEPSEEK_V32_NSA = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 2,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 2048,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 512,
    "first_k_dense_replace": 2,  # == num_hidden_layers: no MoE layer
    "moe_layer_freq": 1,
    "topk_method": "noaux_tc",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "routed_scaling_factor": 1.0,
    "hidden_act": "silu",
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "vocab_size": 32000,
    "max_position_embeddings": 8192,
}
MODEL_DIR = Path("/tmp/kvmig-tiny-deepseek-v32-nsa")

# Where SGLang 0.5.12's NSA backend and indexer import their kernels from.
NSA_KERNEL_MODULES = (
    "sgl_kernel.flash_mla",  # flash_mla_sparse_fwd (prefill), flash_mla_with_kvcache
    "sgl_kernel.flash_attn",  # fa3 decode
    "deep_gemm",  # the indexer's fp8 MQA logits
    "fast_hadamard_transform",  # the indexer's rotation
    "tilelang",
)


def _kernel_modules() -> dict[str, str]:
    found = {}
    for name in NSA_KERNEL_MODULES:
        try:
            module = importlib.import_module(name)
            found[name] = f"ok: {getattr(module, '__file__', '')}"
        except Exception as exc:  # an import error is what this records
            found[name] = f"{type(exc).__name__}: {exc}"
    return found


def test_nsa_model_migrates_with_equal_greedy_output():
    record("nsa_kernel_modules", _kernel_modules())
    write_model(TINY_DEEPSEEK_V32_NSA, MODEL_DIR)
    common = ["--attention-backend", "nsa", "--page-size", str(NSA_PAGE_SIZE)]
    common += ["--mem-fraction-static", "0.15", "--max-total-tokens", "32768"]
    specs = [ServerSpec(PORT_BASE + 10, common, gpu_id=0), ServerSpec(PORT_BASE + 20, common)]
    try:
        with running_servers(MODEL_DIR, specs, sequential=True) as (source, target):
            _migrate_and_compare(source, target)
    except (RuntimeError, TimeoutError) as exc:
        record("nsa_start_failure", str(exc)[-6000:])
        pytest.fail(f"the NSA-shaped model's servers did not start:\n{exc}")


def _migrate_and_compare(source: str, target: str) -> None:
    rng = random.Random(0)
    prompt = [rng.randrange(3, 32000) for _ in range(PROMPT_TOKENS)]
    generate(source, prompt, 1)
    reference = generate(source, prompt, 16)  # served from the source's own cache
    with MigrationClient() as client:
        result = client.migrate(source, target, prompt[:-1])
    on_target = generate(target, prompt, 16)
    expected = (PROMPT_TOKENS - 1) // NSA_PAGE_SIZE * NSA_PAGE_SIZE
    record(
        "nsa_migration",
        {
            "result": result.to_dict(),
            "source_cached_details": cached_details(reference),
            "target_cached_details": cached_details(on_target),
            "outputs_equal": on_target["output_ids"] == reference["output_ids"],
        },
    )
    assert result.migrated_token_size == expected, result
    assert cached_tokens(on_target) >= expected
    assert on_target["output_ids"] == reference["output_ids"]
