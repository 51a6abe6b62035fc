"""The weights file: written once, straight from the checkpoint; every tensor is the checkpoint's, converted by torch
to the folder's dtype and split for its rank; the free-space check and write errors are one line and leave nothing."""
from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Megatron's split, written out here rather than taken from export: q/k/v and gate/up are column-parallel (rows of
# the HF [out, in] weight and of the bias), o_proj and down_proj row-parallel (columns); the rest is replicated
COLUMN = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias",
          "gate_proj.weight", "up_proj.weight")
ROW = ("o_proj.weight", "down_proj.weight")
VOCAB = ("model.embed_tokens.weight", "lm_head.weight")  # by vocabulary rows when the folder is vocab-parallel


def torch_bytes(state, name: str, dtype: str, rank: int, tp: int, vocab_parallel: bool = False) -> bytes:
    """What the folder must hold for `name`: the checkpoint's tensor converted by torch, this rank's share."""
    import torch

    t = state[name]
    if tp > 1 and (name.endswith(COLUMN) or (vocab_parallel and name in VOCAB)):
        t = t.chunk(tp, dim=0)[rank]
    elif name.endswith(ROW) and tp > 1:
        t = t.chunk(tp, dim=1)[rank]
    t = t.to(getattr(torch, dtype)).contiguous()
    return (t.view(torch.int16) if dtype == "bfloat16" else t).numpy().tobytes()


def folder_tensors(folder: str):
    """{(rank, name): (location, offset, length)} over every graph of the folder; a name's place is the same in
    every graph of its rank."""
    from mindspore.train import mind_ir_pb2

    with open(os.path.join(folder, "manifest.json"), encoding="utf-8") as fh:
        manifest = json.load(fh)
    places, caches = {}, {}
    for g in manifest["graphs"]:
        proto = mind_ir_pb2.ModelProto()
        with open(os.path.join(folder, g["file"]), "rb") as fh:
            proto.ParseFromString(fh.read())
        for p in proto.graph.parameter:
            assert not p.raw_data, (g["file"], p.name)
            ext = p.external_data
            key = (g.get("rank", 0), p.name.rsplit(":", 1)[-1])
            if key[1].endswith(("key_cache", "value_cache")):  # the paged KV cache: no data, the runtime's pool
                assert not p.HasField("external_data"), (g["file"], p.name)
                caches.setdefault(key, tuple(p.dims))
                continue
            place = (ext.location, ext.offset, ext.length)
            assert places.setdefault(key, place) == place, key
            assert ext.location == g["variables"]
    assert caches, "no KV cache parameters"
    return places, manifest, caches


def hf_state(checkpoint: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype="auto")
    return {k: v.detach() for k, v in model.state_dict().items()}, model.dtype == torch.bfloat16


def assert_weights_are_the_checkpoints(folder: str, checkpoint: str) -> None:
    import yaml

    places, manifest, caches = folder_tensors(folder)
    with open(os.path.join(folder, manifest["yaml"]), encoding="utf-8") as fh:
        doc = yaml.safe_load(fh)
    infer, config = doc["infer"], doc["model"]["config"]
    tp, b, s = infer["tp_size"], infer["batch_size"], infer["seq_length"]
    vocab_parallel = doc["export"].get("vocab_parallel", False)
    state, _ = hf_state(checkpoint)
    sizes = {}
    for (rank, name), (location, offset, length) in places.items():
        with open(os.path.join(folder, location), "rb") as fh:
            fh.seek(offset)
            data = fh.read(length)
        assert offset % 64 == 0 and len(data) == length
        if name == "model.embed_tokens.vocab_start":  # vocab-parallel: each rank's first row
            assert vocab_parallel and np.frombuffer(data, np.int32).tolist() == [rank * config["vocab_size"] // tp]
        else:
            matrix = state[name].ndim == 2
            dtype = infer["dtype"] if matrix else infer["compute_dtype"]  # CPU 16-bit folders: only the matrices
            assert data == torch_bytes(state, name, dtype, rank, tp, vocab_parallel), (rank, name, dtype)
        sizes.setdefault(location, []).append((offset, length))
    # the caches: declared in blocks (the runtime sets their number), this rank's kv heads, the yaml's layout
    kv = infer["kv_cache"]
    per_rank = config["num_key_value_heads"] // tp
    assert kv["max_blocks"] == -(-s // kv["block_size"]) and kv["kv_heads"] == per_rank
    for (rank, name), dims in caches.items():
        shape = (per_rank, kv["block_size"]) if kv["layout"] == "blocks_heads" else (kv["block_size"], per_rank)
        assert dims[1:] == shape + (config["head_dim"],), (name, dims)
    assert len(caches) == 2 * config["num_hidden_layers"] * tp
    for location, spans in sizes.items():  # the file is the 64-byte header and the tensors, each aligned, no gaps
        spans.sort()
        end = 64
        for offset, length in spans:
            assert offset == end, (location, offset, end)
            end = offset + length + (-length % 64)
        assert os.path.getsize(os.path.join(folder, location)) == end


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory, checkpoints):
    """gqa_tied saved in bfloat16 in three shards, with its tokenizer: a Qwen release's layout."""
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("bf16_ckpt")
    src = checkpoints["gqa_tied"]
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(out, max_shard_size="60KB")
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(src, f), out / f)
    assert len([f for f in os.listdir(out) if f.endswith(".safetensors")]) > 1
    return str(out)


def test_the_scratch_folder_never_holds_anything_but_the_folder(tmp_path, bf16_checkpoint):
    """Atlas float16 from a bf16 checkpoint (the 7B default's conversion), two ranks, batch 3 (slot graphs), a
    bucket: every file the export ever creates is a file of the finished folder, written once, and the graphs hold
    no parameter data; every tensor is torch's conversion of the checkpoint's, split for its rank."""
    from export.config import ExportConfig
    from export.pipeline import run_export
    from watch import CreatedFiles

    out = tmp_path / "m"
    with CreatedFiles(str(tmp_path)) as seen:
        run_export(ExportConfig(checkpoint=bf16_checkpoint, output=str(out), name="m", seq_length=32, batch_size=3,
                                dtype="float16", device="atlas_800i_a2", prefill_buckets=(8,), tp_size=2))
    final = {os.path.relpath(os.path.join(r, f), out).replace(os.sep, "/")
             for r, _, fs in os.walk(out) for f in fs}
    scratch = [p for p in seen.paths if p.startswith(".m.partial-")]
    assert scratch, seen.paths
    inside = {p.split("/", 1)[1] for p in scratch if "/" in p.rstrip("/")}
    assert {p for p in inside if not p.endswith("/")} == final
    assert {p for p in inside if p.endswith("/")} == {"m_rank0_variables/", "m_rank1_variables/"}
    written = {p.split("/", 1)[1]: n for p, n in seen.sizes.items() if p.startswith(".m.partial-")}
    total = sum(os.path.getsize(out / f) for f in final)
    assert sum(written.values()) <= total and sum(written.values()) > 0.9 * total
    assert_weights_are_the_checkpoints(str(out), bf16_checkpoint)
    assert "AllGather" in _primitives(out / "m_rank1_inc_graph.mindir")  # vocab-parallel: 2 divides 512


def _primitives(graph) -> set:
    from mindspore.train import mind_ir_pb2

    proto = mind_ir_pb2.ModelProto()
    with open(graph, "rb") as fh:
        proto.ParseFromString(fh.read())
    return {p.op_type for p in proto.primitives}


def test_a_vocabulary_the_ranks_cannot_share_equally_stays_replicated(tmp_path, tokenizer):
    """vocab 510 over 4 ranks: the embedding and head are whole on every rank, and no logits are gathered."""
    from export.checkpoints import random_checkpoint
    from export.config import ExportConfig
    from export.pipeline import run_export

    ckpt = random_checkpoint.make_checkpoint(str(tmp_path / "ckpt"), vocab_size=510, num_attention_heads=4,
                                                num_key_value_heads=4, tie_word_embeddings=False, seed=5,
                                                tokenizer=tokenizer)
    out = tmp_path / "m"
    run_export(ExportConfig(checkpoint=ckpt, output=str(out), name="m", seq_length=16, batch_size=1,
                            dtype="float32", device="cpu", prefill_buckets=(), tp_size=4))
    assert_weights_are_the_checkpoints(str(out), ckpt)
    assert "AllGather" not in _primitives(out / "m_rank3_inc_graph.mindir")


@pytest.mark.parametrize("kind", ["cpu_float32_buckets", "atlas_float16", "atlas_bfloat16"])
def test_the_session_folders_hold_the_checkpoints_tensors(exported, atlas_exported, checkpoints, kind):
    """float32 as is; float16 and bfloat16 rounded from a float32 checkpoint as torch rounds."""
    folder = {"cpu_float32_buckets": exported["gqa_tied_buckets"], "atlas_float16": atlas_exported["float16"],
              "atlas_bfloat16": atlas_exported["bfloat16"]}[kind]
    assert_weights_are_the_checkpoints(folder, checkpoints["gqa_tied"])


def test_a_cpu_bfloat16_folder_keeps_a_bf16_checkpoint_bit_for_bit_and_rounds_nothing_else(tmp_path, bf16_checkpoint):
    from export.config import ExportConfig
    from export.pipeline import run_export

    out = tmp_path / "cpu"
    run_export(ExportConfig(checkpoint=bf16_checkpoint, output=str(out), name="cpu", seq_length=16, batch_size=1,
                            dtype="bfloat16", device="cpu", prefill_buckets=()))
    assert_weights_are_the_checkpoints(str(out), bf16_checkpoint)


# --- the disk: checked before writing, write errors in one line, nothing kept ----------------------------------

def _export_cmd(checkpoint: str, output: str):
    return [sys.executable, "-m", "export", "-q", "--checkpoint", checkpoint, "--output", output, "--device", "cpu",
            "--seq_length", "16", "--prefill_buckets", "none"]


def test_too_little_free_space_is_refused_before_writing(tmp_path, checkpoints):
    """On a 1 MiB tmpfs (its own mount namespace, as root): one line with both numbers, nothing written."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "--mount", "true"],
                                                         capture_output=True).returncode != 0:
        pytest.skip("needs unshare --mount (root, util-linux) to mount a small tmpfs for the test")
    small = tmp_path / "small"
    small.mkdir()
    script = (f"mount -t tmpfs -o size=1m tmpfs {small} && "
              + " ".join(_export_cmd(checkpoints["mha_untied"], f"{small}/m"))
              + f"; code=$?; ls -A {small}; exit $code")
    proc = subprocess.run(["unshare", "--mount", "sh", "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr
    assert err[0].startswith(f"error: {small}: 1.0 MiB free, the model folder needs ") and err[0].endswith(
        "; free space there or pass an --output on a larger file system"), err[0]
    assert proc.stdout.strip() == ""  # the tmpfs is empty: nothing was written


def test_a_write_error_is_one_line_naming_the_file_and_nothing_is_kept(tmp_path, checkpoints):
    """A file size limit (ulimit -f) stops the weights file mid-write with EFBIG: the error names it, exit 2."""
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write(2) then fails with EFBIG instead of a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    out = tmp_path / "m"
    proc = subprocess.run(_export_cmd(checkpoints["mha_untied"], str(out)), capture_output=True, text=True,
                          timeout=300, cwd=ROOT, preexec_fn=limit)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f"error: {out}/m_variables/data_0: File too large; a file size limit was hit "
                                   "(ulimit -f): raise it or pass another --output (nothing was kept)")
    assert os.listdir(tmp_path) == []


def test_a_full_disk_while_writing_the_weights_names_the_file(tmp_path, checkpoints):
    """ENOSPC from a real device (/dev/full behind the weights file's name) comes back as an OSError naming it."""
    from export.checkpoints import open_checkpoint
    from export.writers.weights_file import Layout, write_files

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this machine")
    ckpt = checkpoints["mha_untied"]
    where = open_checkpoint(ckpt)
    layout = Layout("w_variables/data_0")
    for name in sorted(where):
        layout.add(name, where[name].shape(name), "float32")
    (tmp_path / "w_variables").mkdir()
    os.symlink("/dev/full", tmp_path / "w_variables" / "data_0")
    with pytest.raises(OSError) as caught:
        write_files(str(tmp_path), [layout], where)
    assert (caught.value.errno, caught.value.filename) == (errno.ENOSPC, str(tmp_path / "w_variables" / "data_0"))
    from export.pipeline import _os_error_line

    assert _os_error_line(caught.value, str(tmp_path), "/out/m") == (
        "/out/m/w_variables/data_0: No space left on device; the disk is full: free space there or pass an "
        "--output on a larger file system (nothing was kept)")


# --- the page cache: the export leaves its weights on disk, the load maps them asking for huge pages ------------

def _resident_pages(path: str) -> int:
    """Pages of `path` in the page cache (mincore(2) over a fresh read-only mapping, which touches none)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        region = mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ)
        try:
            pages = -(-size // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            view = np.frombuffer(region, np.uint8)
            assert libc.mincore(view.ctypes.data, size, vec) == 0, os.strerror(ctypes.get_errno())
            del view
            return sum(v & 1 for v in vec)
        finally:
            region.close()


def _filesystem(path: str) -> str:
    """The type of the filesystem `path` is on (/proc/mounts' longest matching mount point)."""
    real, best = os.path.realpath(path), ("", "")
    with open("/proc/mounts") as fh:
        for line in fh:
            point, kind = line.split()[1:3]
            if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) > len(best[0]):
                best = (point, kind)
    return best[1]


def _mappings():
    """This process's mappings: (start, end, path or "", VmFlags) per /proc/self/smaps entry."""
    out, head = [], None
    with open("/proc/self/smaps") as fh:
        for line in fh:
            words = line.split()
            if words and "-" in words[0] and ":" not in words[0]:  # "start-end perms offset dev inode [path]"
                lo, hi = (int(v, 16) for v in words[0].split("-"))
                head = (lo, hi, words[5] if len(words) > 5 else "")
            elif line.startswith("VmFlags:") and head is not None:
                out.append(head + (words[1:],))
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore, /proc/self/smaps: Linux")
@pytest.mark.parametrize("huge_pages", ["default", "0"])
@pytest.mark.parametrize("source,dtype", [("gqa_tied", "float32"), ("mha_untied", "bfloat16")])
def test_the_export_leaves_its_weights_on_disk_and_the_load_puts_the_kernels_weights_in_huge_pages(
        tmp_path, checkpoints, monkeypatch, huge_pages, source, dtype):
    """The finished folder's weights file is flushed and out of the page cache (weights_file.release_cache). Loaded,
    every weight our CPU kernels read (lite_runtime/backends/ms.py _kernel_weights: every one but the KV caches and an
    untied embedding only our lookup kernel reads, cpu_kernels.ROW_READERS, which stays in the file's mapping)
    is a copy of the file's bytes in private memory advised huge (_into_huge_pages; VmFlags `hg` where the kernel has
    transparent huge pages), the file's mapping advised huge too, and the copy counted against the memory available
    (lite_runtime/memory.py weights_copy_bytes: the arena's bytes where they and 1 GiB fit, else nothing), our ops handed
    that copy as one Parameter and each weight's place in it (lite_runtime/backends/arena.py); with
    MSLITE_LLM_HUGE_PAGES=0 they are the mapping's pages, a Parameter each. Either way check replays the golden
    record."""
    from export.config import ExportConfig
    from export.pipeline import run_export
    from lite_runtime import pipeline
    from lite_runtime.backends.arena import ARENA_PARAMETER
    from lite_runtime.backends.ms import _kernel_weights, _parameter_arrays, _read_mindir
    from lite_runtime.check import run_check
    from lite_runtime.folder import is_kv_cache
    from lite_runtime.memory import weights_copy_bytes

    if huge_pages != "default":
        monkeypatch.setenv("MSLITE_LLM_HUGE_PAGES", huge_pages)
    out = tmp_path / "cpu"
    run_export(ExportConfig(checkpoint=checkpoints[source], output=str(out), name="cpu", seq_length=16,
                            batch_size=1, dtype=dtype, device="cpu", prefill_buckets=()))
    data = os.path.realpath(out / "cpu_variables" / "data_0")
    if _filesystem(data) not in ("tmpfs", "ramfs"):  # there the page cache is the file: nothing to drop
        assert _resident_pages(data) == 0
    pipe = pipeline("text_generation", model=str(out), backend="ms", warm_up="none")
    pipe.generate([[1, 2, 3]], max_new_tokens=2)
    # the plan's bytes are what the load copied: the arena, exactly (an untied table left out)
    size = pipe.backend._arena[0].nbytes if huge_pages == "default" else os.path.getsize(data)
    gib = 1 << 30
    assert weights_copy_bytes(pipe.config.folder, 0, have=size + gib) == (size if huge_pages == "default" else 0)
    assert weights_copy_bytes(pipe.config.folder, 0, have=size + gib - 1) == 0
    if source == "mha_untied" and huge_pages == "default":  # the table our lookup reads: mapped, out of the plan
        assert size < os.path.getsize(data)
    graph = str(out / "cpu_inc_graph.mindir")
    model = _read_mindir(graph)
    ours = _kernel_weights(model)
    names = {p.name.rsplit(":", 1)[-1] for p in model.graph.parameter}
    # a bfloat16 folder's untied table: our MsliteLlmEmbed alone reads it, a few rows a step
    looked_up = {"model.embed_tokens.weight"} if source == "mha_untied" else set()
    assert ours and ours == {n for n in names if not is_kv_cache(n)} - looked_up
    maps = _mappings()
    mapping_of = lambda address: next((m for m in maps if m[0] <= address < m[1]), None)
    for table in looked_up:
        where = mapping_of(pipe.backend._owned[table].data_ptr())
        assert where is not None and where[2] == data, (table, where)
    stored = _parameter_arrays(model, graph)
    thp = os.path.isdir("/sys/kernel/mm/transparent_hugepage")
    backend = pipe.backend
    if huge_pages == "default":  # our ops read the weights in the arena, handed over as one Parameter (arena.py)
        arena, places = backend._arena
        assert backend._owned[ARENA_PARAMETER].data_ptr() == arena.ctypes.data and set(places) == ours
    for name in sorted(ours):
        got = backend._weights[name]  # what the graphs' Parameters or the arena's places hold (bfloat16 as uint16)
        assert np.array_equal(got, stored[name]), name
        if huge_pages == "default":
            assert got.ctypes.data == arena.ctypes.data + places[name], name
        else:
            assert backend._owned[name].data_ptr() == got.ctypes.data, name
        where = mapping_of(got.ctypes.data)
        assert where is not None, name
        assert where[2] == ("" if huge_pages == "default" else data), (name, where[2])
        assert not thp or "hg" in where[3], (name, where[3])
    del pipe, stored
    report = run_check(str(out), backend="ms")
    assert report.passed, report.table()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps: Linux")
def test_the_huge_page_arena_is_zeroed_private_memory_at_a_huge_page_asking_for_huge_pages():
    """lite_runtime/backends/ms.py _huge_arena, the home of the weights our kernels read: exactly the bytes asked, at
    a 2 MiB boundary, zero, writable, private (not shared memory, which takes no transparent huge pages), and advised
    huge (VmFlags `hg`) where the kernel has transparent huge pages."""
    from lite_runtime.backends.ms import HUGE_PAGE, _huge_arena

    arena = _huge_arena(3 * HUGE_PAGE + 5)
    assert arena.shape == (3 * HUGE_PAGE + 5,) and arena.dtype == np.uint8
    assert arena.ctypes.data % HUGE_PAGE == 0 and not arena.any()
    arena[::4096] = 7
    assert int(arena.sum()) == 7 * len(range(0, arena.size, 4096))
    flags = next((f for lo, hi, _, f in _mappings() if lo <= arena.ctypes.data < hi), None)
    assert flags is not None and "sh" not in flags, flags
    if os.path.isdir("/sys/kernel/mm/transparent_hugepage"):
        assert "hg" in flags, flags
