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

import os
import random
import sys
from pathlib import Path

import pytest
from sglang_kv_migration.client.migration import MigrationClient

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_servers import (  # noqa: E402
    TINY_DEEPSEEK_V32_NSA,
    ServerSpec,
    cached_details,
    cached_tokens,
    generate,
    nsa_kernel_modules,
    record,
    running_servers,
    write_model,
)

pytestmark = pytest.mark.gpu

PORT_BASE = int(os.environ.get("KVMIG_PORT_BASE", "30800"))
NSA_PAGE_SIZE = 64  # SGLang forces it for DeepSeek DSA on CUDA
PROMPT_TOKENS = 3000  # > index_topk: the sparse path runs

# The shared V3.2 shape with 2 layers (all dense) and 128 query heads, as V3.2 has.
NSA_TEST_MODEL = {
    **TINY_DEEPSEEK_V32_NSA,
    "num_hidden_layers": 2,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "first_k_dense_replace": 2,
}
# One directory per port base: two runs side by side never write the same config file.
MODEL_DIR = Path(f"/tmp/kvmig-tiny-deepseek-v32-nsa-{PORT_BASE}")


def test_nsa_model_migrates_with_equal_greedy_output():
    record("nsa_kernel_modules", nsa_kernel_modules())
    write_model(NSA_TEST_MODEL, MODEL_DIR)
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
