"""Models larger than memory: the memory plan, the cgroup limit, the expert cache's policy, and a
real run under a memory cgroup (skipped where one cannot be created)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import colibri
from colibri import _os, residency
from colibri._os import _cgroup
from colibri._engine import CacheProbe
from conftest import big_checkpoint

ENV = dict(os.environ, PYTHONPATH=str(Path(colibri.__file__).parent.parent))
MB = 1 << 20


# ---- the plan -------------------------------------------------------------------------------------


def _plan(limit, **kw):
    args = dict(
        dense=100 * MB,
        experts=1000 * MB,
        kv=10 * MB,
        scratch=5 * MB,
        runtime=50 * MB,
        working_set=40 * MB,
        n_ctx=256,
        path="m",
    )
    args.update(kw)
    return residency.plan(limit, "test", **args)


def test_plan_budget_is_the_limit_less_what_is_fixed():
    p = _plan(800 * MB)
    margin = max(residency.MIN_MARGIN, int(800 * MB * residency.MARGIN_FRACTION))
    assert p.fixed == 100 * MB + 10 * MB + 5 * MB + 50 * MB + margin
    assert p.budget == 800 * MB - p.fixed
    assert p.minimum == p.fixed + 40 * MB


def test_plan_without_a_budget_when_the_model_fits():
    assert _plan(4000 * MB).budget is None
    assert _plan(None).budget is None


def test_plan_below_the_minimum_is_one_clear_error():
    with pytest.raises(
        colibri.ColibriError,
        match=r"memory limit 200 MB .* below .* dense weights 100 MB "
        r".* KV cache 10 MB \(n_ctx 256\).* lower --n-ctx",
    ):
        _plan(200 * MB)
    # several sequences' caches (load(parallel=)): the line says so and names --parallel
    with pytest.raises(
        colibri.ColibriError, match=r"KV cache 40 MB \(n_ctx 256 x 4 sequences\).* lower --n-ctx or --parallel$"
    ):
        _plan(200 * MB, kv=40 * MB, n_seq=4)


@given(
    limit=st.integers(1, 1 << 40),
    dense=st.integers(0, 1 << 36),
    experts=st.integers(1, 1 << 38),
    kv=st.integers(0, 1 << 34),
    working=st.integers(1, 1 << 32),
)
def test_plan_never_plans_past_the_limit(limit, dense, experts, kv, working):
    try:
        p = _plan(limit, dense=dense, experts=experts, kv=kv, working_set=working)
    except colibri.ColibriError:
        assert (
            limit
            < dense
            + kv
            + 5 * MB
            + 50 * MB
            + max(residency.MIN_MARGIN, int(limit * residency.MARGIN_FRACTION))
            + working
        )
        return
    if p.budget is None:
        assert p.fixed + experts <= limit
    else:
        assert p.fixed + p.budget == limit and p.budget >= working


def test_cli_cap_below_the_minimum_fails_before_loading(tmp_path):
    demo = Path(colibri.__file__).parent / "data" / "demo"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "colibri",
            "run",
            "--model-dir",
            str(demo),
            "--prompt",
            "In the",
            "--memory-limit-mb",
            "1",
        ],
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2  # the CLI's code for a user's error
    assert "memory limit 1 MB (memory_limit_mb) is below" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def _wide_ffn_checkpoint(root: Path) -> Path:
    """One OLMoE-shaped layer, hidden 64, four experts 8192 wide (6 MB each in f32): a model whose
    scratch (rows of the FFN width per prefill token) is a large part of its memory."""
    from conftest import FIXTURES, write_safetensors

    cfg = json.loads((FIXTURES / "olmoe_a" / "hf" / "config.json").read_text())
    d, f = 64, 8192
    cfg.update(
        hidden_size=d,
        intermediate_size=f,
        num_experts=4,
        num_experts_per_tok=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=1,
        vocab_size=128,
    )
    rng = np.random.default_rng(0)
    t = {
        "model.embed_tokens.weight": rng.standard_normal((128, d), np.float32),
        "lm_head.weight": rng.standard_normal((128, d), np.float32),
        "model.norm.weight": np.ones(d, np.float32),
    }
    p = "model.layers.0."
    for n in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
        t[p + n + ".weight"] = np.ones(d, np.float32)
    for n in "qkvo":
        t[p + f"self_attn.{n}_proj.weight"] = 0.1 * rng.standard_normal((d, d), np.float32)
    t[p + "mlp.gate.weight"] = rng.standard_normal((4, d), np.float32)
    for e in range(4):
        for n, shape in (("gate_proj", (f, d)), ("up_proj", (f, d)), ("down_proj", (d, f))):
            t[p + f"mlp.experts.{e}.{n}.weight"] = 0.02 * rng.standard_normal(shape, np.float32)
    root.mkdir()
    (root / "config.json").write_text(json.dumps(cfg))
    write_safetensors(root / "model.safetensors", t)
    return root


def test_a_tight_limit_lowers_the_default_prefill_chunk(tmp_path):
    """The scratch grows with the prefill chunk: under a limit that the default chunk's scratch
    does not leave room in, the plan halves the chunk until it does (and says so); a chunk the
    caller chose is kept, and the limit refused."""
    from colibri.convert import convert

    convert(_wide_ffn_checkpoint(tmp_path / "hf"), tmp_path / "m", log=lambda *a: None)
    small = colibri.load(tmp_path / "m", n_ctx=256, prefill_chunk=16, memory_limit_mb=4000)
    big = colibri.load(tmp_path / "m", n_ctx=256, memory_limit_mb=4000)
    assert big._engine.scratch_bytes > small._engine.scratch_bytes + 6 * MB
    plan = small.residency.plan
    unmargined = plan.fixed - max(residency.MIN_MARGIN, int(plan.limit * residency.MARGIN_FRACTION))
    limit = unmargined + residency.MIN_MARGIN + small.residency.working_set + 3 * MB
    small.close(), big.close()
    m = colibri.load(tmp_path / "m", n_ctx=256, memory_limit_mb=limit / MB)
    assert m.residency.plan.lowered_chunk is not None and m.residency.plan.lowered_chunk < 128
    assert f"prefill chunk lowered to {m.residency.plan.lowered_chunk}" in m.residency.plan.describe()
    ids = list(range(1, 100))
    free = colibri.load(tmp_path / "m", n_ctx=256)
    np.testing.assert_array_equal(m.forward(ids), free.forward(ids))  # the chunking changes no logit
    with pytest.raises(colibri.ColibriError, match=r"is below.*or a smaller prefill chunk than the 128 asked for"):
        colibri.load(tmp_path / "m", n_ctx=256, prefill_chunk=128, memory_limit_mb=limit / MB)


def test_no_mmap_over_the_limit_is_refused_before_reading():
    demo = Path(colibri.__file__).parent / "data" / "demo"
    with pytest.raises(
        colibri.ColibriError,
        match=r"cannot be read into memory under the memory limit of 40 MB "
        r"\(memory_limit_mb\); map it instead",
    ):
        colibri.load(demo, mmap=False, memory_limit_mb=40)
    colibri.load(demo, mmap=False, memory_limit_mb=4000).close()


def test_memory_limit_mb_sizes_the_expert_budget():
    demo = Path(colibri.__file__).parent / "data" / "demo"
    need = colibri.load(demo, n_ctx=64, memory_limit_mb=4000)
    assert need.expert_budget is None and need.residency.plan.source == "memory_limit_mb"  # it fits
    plan = need.residency.plan
    unmargined = plan.fixed - max(residency.MIN_MARGIN, int(plan.limit * residency.MARGIN_FRACTION))
    need.close()
    # room for the fixed part (a small limit's margin), two layers' choices and ~20 more experts of 8 MB
    limit = unmargined + residency.MIN_MARGIN + need.residency.working_set + 5 * MB
    m = colibri.load(demo, n_ctx=64, memory_limit_mb=limit / MB)
    assert m.expert_budget == m.residency.plan.budget == m.residency.plan.limit - m.residency.plan.fixed
    assert m.residency.working_set <= m.expert_budget < m.residency.expert_bytes
    assert m.prefetch == "routed"
    ids = [1, 5, 9, 33, 2]
    free = colibri.load(demo, n_ctx=64)
    kw = dict(max_new_tokens=16, stop_at_eos=False)
    assert list(m.generate(ids, **kw)) == list(free.generate(ids, **kw))
    assert m.memory_stats()["peak_resident_expert_bytes"] <= m.expert_budget


# ---- the cgroup limit ---------------------------------------------------------------------------------


def _tree(tmp_path, cgroup: str, mountinfo: str, files: dict) -> str:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text(mountinfo)
    for rel, text in files.items():
        p = tmp_path / "root" / rel.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return str(proc)


V2_MOUNT = "30 24 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNT = (
    "35 30 0:31 / /sys/fs/cgroup/memory rw,nosuid shared:15 - cgroup cgroup rw,memory\n"
    "36 30 0:32 / /sys/fs/cgroup/cpu rw,nosuid shared:16 - cgroup cgroup rw,cpu\n"
)


def test_cgroup_v2_takes_the_tightest_limit_up_the_tree(tmp_path):
    proc = _tree(
        tmp_path,
        "0::/system.slice/colibri.service\n",
        V2_MOUNT,
        {
            "/sys/fs/cgroup/system.slice/colibri.service/memory.max": "max\n",
            "/sys/fs/cgroup/system.slice/colibri.service/memory.high": "max\n",
            "/sys/fs/cgroup/system.slice/colibri.service/memory.current": "1000\n",
            "/sys/fs/cgroup/system.slice/memory.max": "838860800\n",
            "/sys/fs/cgroup/system.slice/memory.high": "1073741824\n",
            "/sys/fs/cgroup/memory.max": "max\n",
        },
    )
    found = _cgroup.find(proc, str(tmp_path / "root"))
    assert found.limit == 800 * MB and found.source.endswith("system.slice/memory.max")
    assert _cgroup.usage(found) == (1000, None)  # memory.peak absent (Linux < 5.19)


def test_cgroup_v1_reads_the_hierarchical_limit(tmp_path):
    proc = _tree(
        tmp_path,
        "5:cpu:/\n4:memory:/docker/abc\n0::/\n",
        V1_MOUNT + V2_MOUNT,
        {
            "/sys/fs/cgroup/memory/docker/abc/memory.stat": "cache 1\nhierarchical_memory_limit 524288000\n",
            "/sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": "9223372036854771712\n",
            "/sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes": "123\n",
            "/sys/fs/cgroup/memory/docker/abc/memory.max_usage_in_bytes": "456\n",
        },
    )
    found = _cgroup.find(proc, str(tmp_path / "root"))  # hybrid: the v2 mount has no memory.max
    assert found.limit == 500 * MB and found.source.endswith("memory.stat")
    assert _cgroup.usage(found) == (123, 456)


@pytest.mark.parametrize("value", ["9223372036854771712\n", "max\n", "", "garbage"])
def test_cgroup_without_a_limit(tmp_path, value):
    proc = _tree(tmp_path, "4:memory:/\n", V1_MOUNT, {"/sys/fs/cgroup/memory/memory.limit_in_bytes": value})
    assert _cgroup.find(proc, str(tmp_path / "root")) is None


def test_no_cgroup_files_at_all(tmp_path):
    assert _cgroup.find(str(tmp_path / "absent"), str(tmp_path)) is None


# ---- the expert cache's policy, against a model of it -------------------------------------------------


class CacheModel:
    """csrc/expert_cache.h's bookkeeping in Python (the policy as documented there)."""

    def __init__(self, lengths, budget, policy):
        self.n, self.lengths, self.budget, self.policy = len(lengths), lengths, budget, policy
        self.resident, self.fresh = [0] * self.n, [0] * self.n
        self.last_use = [0] * self.n
        self.freq = np.zeros(self.n, np.float32)
        self.bytes = self.clock = self.layer_start = self.uses = self.evictions = self.over = 0

    def _victim(self):
        best = None
        for i in range(self.n):
            if not self.resident[i] or self.last_use[i] >= self.layer_start:
                continue
            if best is None:
                best = i
            elif self.fresh[i] != self.fresh[best]:
                best = i if self.fresh[i] else best
            elif self.policy == "lfu":
                if self.freq[i] < self.freq[best] or (
                    self.freq[i] == self.freq[best] and self.last_use[i] < self.last_use[best]
                ):
                    best = i
            elif self.last_use[i] < self.last_use[best]:
                best = i
        return best

    def _admit(self, i):
        while self.bytes + self.lengths[i] > self.budget:
            v = self._victim()
            if v is None:
                self.over += 1
                break
            self.resident[v], self.fresh[v] = 0, 0
            self.bytes -= self.lengths[v]
            self.evictions += 1
        self.resident[i] = 1
        self.bytes += self.lengths[i]

    def layer(self):
        self.clock += 1
        self.layer_start = self.clock

    def use(self, i):
        if not self.resident[i]:
            self._admit(i)
        self.fresh[i] = 0
        self.clock += 1
        self.last_use[i] = self.clock
        self.freq[i] += np.float32(1)
        self.uses += 1
        if self.uses >= self.n:
            self.freq *= np.float32(0.5)
            self.uses = 0

    def prefetch(self, i):
        if not self.resident[i]:
            self._admit(i)
            self.fresh[i] = 1
            self.clock += 1
            self.last_use[i] = self.clock

    def done(self, i):
        self.last_use[i] = self.layer_start - 1 - (self.n - i % self.n)


OPS = st.lists(st.tuples(st.sampled_from(["layer", "use", "prefetch", "done"]), st.integers(0, 11)), max_size=120)


@settings(max_examples=60, deadline=None)
@given(
    pages=st.lists(st.integers(1, 3), min_size=1, max_size=12),
    budget_pages=st.integers(1, 20),
    policy=st.sampled_from(["lru", "lfu"]),
    ops=OPS,
)
def test_expert_cache_follows_its_policy(pages, budget_pages, policy, ops):
    page = _os.page_size()
    lengths = [p * page for p in pages]
    probe = CacheProbe(lengths, budget_pages * page, policy)
    model = CacheModel(lengths, budget_pages * page, policy)
    try:
        for op, i in ops:
            i %= len(lengths)
            if op == "layer":
                probe.layer(), model.layer()
            else:
                getattr(probe, op)(i), getattr(model, op)(i)
            assert list(probe.resident) == model.resident
            assert probe.bytes[0] == model.bytes == sum(n for n, r in zip(lengths, model.resident) if r)
            assert model.bytes <= model.budget or model.over > 0
        probe.drain()
        stats = dict(zip(colibri._engine.CACHE_STATS, probe.stats))
        assert stats["evictions"] == model.evictions and stats["over_budget"] == model.over
        assert stats["drops"] <= stats["evictions"] and stats["advice_failures"] == 0
    finally:
        probe.close()


def test_the_current_layers_experts_are_never_evicted():
    page = _os.page_size()
    probe = CacheProbe([page] * 4, 2 * page)
    try:
        probe.layer()
        probe.use(0), probe.use(1), probe.use(2)  # all three in use: the budget cannot hold
        assert list(probe.resident[:3]) == [1, 1, 1]
        probe.drain()
        assert probe.stats[colibri._engine.CACHE_STATS["over_budget"]] == 1
        probe.layer()
        probe.prefetch(3)  # the next layer's guess evicts the coldest two
        assert list(probe.resident) == [0, 0, 1, 1]
    finally:
        probe.close()


def test_a_wrong_prediction_leaves_first():
    page = _os.page_size()
    probe = CacheProbe([page] * 4, 3 * page)
    try:
        probe.layer(), probe.use(0)
        probe.prefetch(1)  # guessed for the next layer
        probe.layer(), probe.use(2)  # which chose 2 instead
        probe.layer(), probe.use(3)  # room for 3: the unused guess goes, not the older 0
        assert list(probe.resident) == [1, 0, 1, 1]
        probe.drain()
        assert probe.stats[colibri._engine.CACHE_STATS["wasted_prefetches"]] == 1
    finally:
        probe.close()


def test_drops_leave_the_page_cache(tmp_path):
    """An expert evicted under a budget leaves the process and the page cache (MADV_DONTNEED +
    POSIX_FADV_DONTNEED): after a run, what the OS holds of the expert files is what the cache
    admitted."""
    if not sys.platform.startswith("linux"):
        pytest.skip("posix_fadvise and mincore page-cache residency are Linux behaviour")
    from colibri.convert import convert

    convert(big_checkpoint(tmp_path / "hf"), tmp_path / "m", log=lambda *a: None)
    os.sync()  # dirty pages of the new files cannot be dropped
    for rel in colibri.modeldir.ModelDir(tmp_path / "m").files:
        _os.evict_file_cache(tmp_path / "m" / rel)
    budget_mb = 6 * 1.5
    m = colibri.load(tmp_path / "m", expert_cache_mb=budget_mb, n_ctx=128)
    list(m.generate(list(range(1, 40)), max_new_tokens=16, stop_at_eos=False))
    st = m.memory_stats()
    assert st["experts_released"] > 0 and st["experts_dropped"] > 0
    assert st["peak_resident_expert_bytes"] <= budget_mb * MB
    assert st["expert_bytes_in_memory"] <= budget_mb * MB
    m.close()


# ---- under a real memory cgroup --------------------------------------------------------------------------


def _make_cgroup(limit: int):
    """A memory cgroup with `limit` bytes (v2 if this system has a writable one, else v1), or
    skip. Returns (directory, version)."""
    name = f"colibri-test-{uuid.uuid4().hex[:8]}"
    found = _cgroup.find()
    for base, version, limit_file in (
        ("/sys/fs/cgroup", 2, "memory.max"),
        ("/sys/fs/cgroup/memory", 1, "memory.limit_in_bytes"),
    ):
        d = Path(base) / name
        if version == 2 and not (Path(base) / "cgroup.controllers").exists():
            continue
        try:
            d.mkdir()
        except OSError:
            continue
        try:
            (d / limit_file).write_text(str(limit))
        except OSError:
            d.rmdir()
            continue
        return d, version
    pytest.skip(f"no memory cgroup can be created here (limit now: {found})")


CAPPED_CHILD = r"""
import json, sys, numpy as np, colibri
from colibri import _os
from colibri.modeldir import ModelDir
md = ModelDir(sys.argv[1])
for rel in md.files:
    _os.evict_file_cache(md.root / rel)
limit = json.loads(sys.argv[2])
m = colibri.load(sys.argv[1], threads=1, n_ctx=128, memory_limit_mb=limit)
out = list(m.generate(list(range(1, 40)), max_new_tokens=16, stop_at_eos=False))
st = m.memory_stats()
print(json.dumps({"tokens": out, "limit": m.residency.plan.limit, "source": m.residency.plan.source,
                  "fixed": m.residency.plan.fixed, "budget": m.expert_budget, "peak": st["cgroup_peak_bytes"],
                  "working_set": m.residency.working_set, "experts": m.residency.expert_bytes}))
"""


def _child(model, limit_mb, cgroup=None):
    cmd = [sys.executable, "-c", CAPPED_CHILD, str(model), json.dumps(limit_mb)]
    if cgroup is not None:
        cmd = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh"] + cmd
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def test_a_model_larger_than_its_cgroup_runs_under_it(tmp_path):
    """In a memory cgroup smaller than the model (page cache included), with no option given:
    the budget is the cgroup's limit less what is fixed (the documented plan), the tokens are the
    uncapped ones, and the group never reaches its limit (v1 failcnt 0: nothing was reclaimed
    behind the engine's back)."""
    from colibri.convert import convert

    convert(big_checkpoint(tmp_path / "hf"), tmp_path / "m", log=lambda *a: None)
    model = tmp_path / "m"
    free = _child(model, 4000)  # the whole model fits: no budget, the plan's figures
    assert free["budget"] is None
    unmargined = free["fixed"] - max(residency.MIN_MARGIN, int(4000 * MB * residency.MARGIN_FRACTION))
    page = _os.page_size()  # the kernel keeps limits in whole pages
    # room for the fixed part (a small limit's margin), two layers' choices and about 5 experts more
    limit = (unmargined + residency.MIN_MARGIN + free["working_set"] + 8 * MB) // page * page
    assert limit < free["fixed"] + free["experts"]
    d, version = _make_cgroup(limit)
    try:
        out = _child(model, None, cgroup=d)
        assert out["tokens"] == free["tokens"]
        assert out["limit"] == limit and out["source"].startswith(str(d))
        assert out["budget"] == limit - out["fixed"] and out["working_set"] <= out["budget"] < out["experts"]
        if version == 1:
            assert (d / "memory.failcnt").read_text().strip() == "0"
            assert int((d / "memory.max_usage_in_bytes").read_text()) <= limit
    finally:
        try:
            d.rmdir()
        except OSError:
            pass


@pytest.mark.parametrize(
    "case, dtype",
    [
        ("gpt_oss_b", "f32"),
        ("gpt_oss_b", "mxfp4"),
        ("deepseekv3_a", "f32"),
        ("deepseekv3_a", "int4"),
        ("glm4moe_a", "f32"),
        ("glm4moe_a", "int8"),
    ],
)
def test_new_families_under_an_expert_budget_give_the_same_logits(converted, case, dtype):
    """gpt-oss (expert biases in the expert files, mxfp4 experts), DeepSeek-V3 (MLA, shared
    experts, a dense layer) and GLM-4.5 (the same router, partial rotary, attention biases) under
    an expert budget of a quarter of the experts: the cache evicts and re-reads them, prefill
    streams one expert at a time, and the logits are those without a budget."""
    from colibri.modeldir import ModelDir
    from conftest import reference

    d = converted(case, dtype)
    ref = reference(case)
    free = colibri.load(d).forward(ref["input_ids"])
    md = ModelDir(d)
    experts = sum(t["nbytes"] for n, t in md.tensors.items() if ".experts." in n)
    capped = colibri.load(d, expert_cache_mb=experts / 4 / 2**20)
    np.testing.assert_array_equal(capped.forward(ref["input_ids"]), free)
    assert capped.memory_stats()["experts_released"] > 0


@pytest.mark.parametrize("case, dtype", [("deepseekv3_a", "f32"), ("gpt_oss_b", "mxfp4"), ("glm4moe_a", "int8")])
def test_new_families_under_a_memory_limit_give_the_same_tokens(converted, monkeypatch, case, dtype):
    """memory_limit_mb with room for the fixed part (a small limit's margin), two layers' choices
    and one expert more: the plan gives the experts a budget smaller than they are, the cache
    evicts, and greedy decoding gives the tokens of the model without a limit. The process's
    resident memory, which the plan counts as fixed, is held at its value before the loads: these
    experts are a few pages each, less than what the interpreter's memory moves between loads."""
    from conftest import reference

    d = converted(case, dtype)
    ref = reference(case)
    rss = _os.rss_bytes()
    monkeypatch.setattr(_os, "rss_bytes", lambda: rss)
    need = colibri.load(d, n_ctx=64, memory_limit_mb=4000)
    assert need.expert_budget is None and need.residency.plan.source == "memory_limit_mb"  # it fits
    plan, res = need.residency.plan, need.residency
    unmargined = plan.fixed - max(residency.MIN_MARGIN, int(plan.limit * residency.MARGIN_FRACTION), res.largest_expert)
    limit = unmargined + residency.MIN_MARGIN + res.working_set + res.largest_expert
    need.close()
    assert res.working_set + res.largest_expert < res.expert_bytes
    m = colibri.load(d, n_ctx=64, memory_limit_mb=limit / MB)
    assert m.expert_budget == m.residency.plan.budget == m.residency.plan.limit - m.residency.plan.fixed
    assert m.residency.working_set <= m.expert_budget < m.residency.expert_bytes
    free = colibri.load(d, n_ctx=64)
    kw = dict(max_new_tokens=len(ref["greedy_ids"]), stop_at_eos=False)
    tokens = list(m.generate(ref["input_ids"], **kw))
    assert tokens == list(free.generate(ref["input_ids"], **kw))
    if dtype == "f32":
        assert tokens == ref["greedy_ids"].tolist()
    st = m.memory_stats()
    assert st["experts_released"] > 0 and st["peak_resident_expert_bytes"] <= m.expert_budget
    m.close(), free.close()


@pytest.mark.parametrize(
    "case, options",
    [
        ("mixtral_a", {}),
        ("qwen3moe_a", {"kv_cache": "q8", "parallel": 3}),
        ("deepseekv3_a", {"kv_cache": "f16"}),
        ("gemma4_a", {"prefill_chunk": 16}),
        ("gpt_oss_a", {"n_ctx": 96}),
        ("olmoe_a", {"threads": 1}),
    ],
)
def test_the_plan_sizes_the_engine_without_building_it(converted, case, options):
    """The memory plan takes the KV cache's and the scratch's bytes from _engine.planned_bytes
    (the engine is built once, after the plan): they are what the built engine allocated, for MLA,
    sliding-window rings, every KV cache type, several sequences and prefill chunks."""
    from colibri import _engine

    m = colibri.load(converted(case), **options)
    try:
        assert _engine.planned_bytes(m.engine_spec) == (m._engine.kv_cache_bytes, m._engine.scratch_bytes)
        assert m.kv_cache_bytes > 0 and m._engine.scratch_bytes > 0
    finally:
        m.close()
