"""Safe checkpoints: a manifest per step, the resume choice, saves on SIGTERM/SIGINT, full disks.

Every step folder TorchTitan's checkpointer writes (``<dump_folder>/checkpoint/step-N``) gets,
once every rank's DCP save of it has finished, ``hymo_manifest.json``: the tokenizer's identity
(a SHA-256 of its files in ``model.hf_assets_path`` and its vocabulary size), the flavor, the
model args that set parameter shapes, muP's effective base width (``mup_base_width``, 0 = muP off;
a manifest without it was written with muP off), and the size and CRC-32 of every file of the
folder (each rank checksums the shards it wrote, right after writing them). A save runs:

1. rank 0 clears the folders of unfinished saves (a marker, no manifest: a resume skips them,
   and TorchTitan's ``keep_latest_k`` would count them): one whose DCP data is complete
   (``.metadata`` and every shard it names; only the manifest is missing) is moved, untouched,
   to ``unfinished/step-N.unfinished-<time>`` in the checkpoint folder, a name that neither the
   resume nor ``keep_latest_k`` (which match ``step-N`` in the folder's own entries) sees (the
   newest UNFINISHED_KEEP stay there); one
   with incomplete data is removed. Then it replaces a leftover folder of that step (a skipped
   save; an unfinished one is moved or removed as above) and writes the marker ``.hymo_saving``
   into the new one;
2. TorchTitan's save (DCP: shards, then ``.metadata``);
3. the checksums, gathered on rank 0, which writes the manifest last (a temporary file and a
   rename) and removes the marker.

``plan_resume`` picks the step a resume loads, before anything is built (preflight.py checks it):
the newest step with a manifest; a folder with a marker (a save that did not finish, whatever it
holds) or, in a folder of manifest-carrying steps, without a manifest is skipped with a warning.
A folder where no step has a manifest or a marker was written before HyMo wrote manifests: its
newest step with ``.metadata`` is resumed, with a warning that nothing could be checked.
``check_manifest`` compares the manifest with this run (tokenizer, flavor, shape, muP) and every
file with its size and checksum (each rank of a resuming run reads its share of the files). Async checkpointing is refused (preflight): its completion is
not seen here.

``SaveGuard`` installs steps 1-3 on a Trainer, makes TorchTitan load the step ``plan_resume``
chose, reports a full disk during a save as such (the previous checkpoint stays the one a
resume picks), and, with ``[hymo] checkpoint_on_signal``, turns SIGTERM/SIGINT into a checkpoint
at the next step boundary (every rank agrees on that step) and a clean exit (code 0).
"""

from __future__ import annotations

import concurrent.futures
import copy
import errno
import hashlib
import json
import os
import re
import shutil
import signal
import time
import zlib
from dataclasses import dataclass, field

from hymo_recipes.titan.api import logger

MANIFEST = "hymo_manifest.json"
SAVING = ".hymo_saving"
FORMAT = 1
# the files HF tokenizers are read from (TorchTitan's HuggingFaceTokenizer reads a subset)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "vocab.txt", "merges.txt", "tokenizer.model")
# HymoModelArgs fields that change a parameter's or persistent buffer's shape
SHAPE_FIELDS = ("vocab_size", "dim", "n_layers", "mla_layers", "gdn_n_heads", "gdn_head_dim", "gdn_v_head_dim",
                "gdn_conv_size", "gdn_ffn_dim", "n_heads", "n_kv_heads", "q_lora_rank", "kv_lora_rank",
                "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "moe_num_experts", "moe_num_shared_experts",
                "moe_inter_dim", "mtp_depth", "mtp_inter_dim")
CHUNK = 8 << 20


class CheckpointSaveError(RuntimeError):
    """A save failed in a way named in its message (a full disk)."""


# -- identity ----------------------------------------------------------------------------------

_tokenizer_ids: dict[tuple, dict] = {}


def tokenizer_identity(path: str) -> dict:
    """SHA-256 over the tokenizer files in `path` (names and bytes) and the vocabulary size."""
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file, "rb") as f:
                digest.update(name.encode() + b"\0" + hashlib.sha256(f.read()).digest())
    key = (os.path.abspath(path), digest.hexdigest())
    if key not in _tokenizer_ids:
        from hymo_recipes.titan.datasets import load_tokenizer

        _tokenizer_ids[key] = {"sha256": digest.hexdigest()[:16], "vocab_size": load_tokenizer(path).get_vocab_size(),
                               "path": os.path.abspath(path)}
    return dict(_tokenizer_ids[key])


def run_identity(config) -> dict | None:
    """What a checkpoint of this run must match to be resumed: tokenizer, flavor, shape and muP's
    base width (it changes init, lrs, MLA's softmax scale and the logits, not a shape; HyMo models
    only; ``[hymo] vocab_size`` already set by the preflight)."""
    if config.model.name != "hymo":
        return None
    from hymo_recipes.model import hymo_flavors

    args = copy.deepcopy(hymo_flavors[config.model.flavor])
    args.update_from_config(config)
    shape = {name: (list(v) if isinstance(v := getattr(args, name), tuple) else v) for name in SHAPE_FIELDS}
    return {"tokenizer": tokenizer_identity(config.model.hf_assets_path), "flavor": config.model.flavor, "shape": shape,
            "mup_base_width": args.mup_base_width}


def manifest_mup_base_width(identity: dict) -> int:
    """The muP base width a manifest's identity records; 0 (muP off) for a manifest written
    before it was recorded."""
    return int(identity.get("mup_base_width", 0))


def describe_mup(base_width: int) -> str:
    return f"mup_base_width {base_width}" + (" (muP off)" if base_width == 0 else "")


def file_crc32(path: str) -> str:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


# -- resume choice -----------------------------------------------------------------------------

@dataclass
class ResumePlan:
    folder: str
    target: int | None  # the step to load, None: start afresh
    path: str | None = None
    skipped: list[tuple[int, str]] = field(default_factory=list)
    earlier: list[int] = field(default_factory=list)  # loadable steps before the target, oldest first
    unchecked: str | None = None  # why the target has no manifest to check against
    exists: bool = True  # False: load_step names a step without a whole checkpoint (TorchTitan says so)


def _has(path: str, name: str) -> bool:
    return os.path.isfile(os.path.join(path, name))


def plan_resume(folder: str, load_step: int = -1) -> ResumePlan | None:
    """The step a resume loads from `folder` and the steps it skips (module docstring); None
    if there is no checkpoint folder."""
    if not os.path.isdir(folder):
        return None
    steps = {int(m.group(1)): os.path.join(folder, name)
             for name in os.listdir(folder) if (m := re.fullmatch(r"step-(\d+)", name))}
    # what TorchTitan counts as a checkpoint: DCP's .metadata, or an HF index
    whole = {s for s, p in steps.items() if _has(p, ".metadata") or _has(p, "model.safetensors.index.json")}
    manifested = {s for s in whole if _has(steps[s], MANIFEST)}
    saving = {s for s, p in steps.items() if _has(p, SAVING) and not _has(p, MANIFEST)}
    uses_manifests = bool(manifested or saving)
    candidates = manifested if uses_manifests else whole - saving
    if load_step != -1:
        if load_step not in whole:
            return ResumePlan(folder, load_step, steps.get(load_step), exists=False)
        target = load_step
    else:
        target = max(candidates) if candidates else None

    def why(s: int) -> str:
        if s not in whole:
            return "no .metadata: a save that did not finish"
        if s in saving:
            return f"no {MANIFEST}: a save that did not finish"
        return f"no {MANIFEST}, unlike the other steps"

    plan = ResumePlan(folder, target, steps.get(target) if target is not None else None)
    skip_from = -1 if target is None else target
    plan.skipped = [(s, why(s)) for s in sorted(steps) if s > skip_from and (load_step == -1 or s not in whole)]
    plan.earlier = sorted(s for s in whole - saving if target is not None and s < target)
    if target is not None and target not in manifested:
        plan.unchecked = (f"it has no {MANIFEST} (a save that did not finish)" if target in saving
                          else f"it has no {MANIFEST} (written before HyMo recorded tokenizer, model shape and "
                               "checksums, or the file was removed)")
    return plan


def unfinished_saves(folder: str) -> list[str]:
    """The step folders of `folder` whose save began (its marker) and never wrote its manifest."""
    if not os.path.isdir(folder):
        return []
    return sorted(os.path.join(folder, n) for n in os.listdir(folder)
                  if re.fullmatch(r"step-\d+", n) and _has(os.path.join(folder, n), SAVING)
                  and not _has(os.path.join(folder, n), MANIFEST))


UNFINISHED = "unfinished"  # the checkpoint folder's subfolder for unfinished saves with complete data
UNFINISHED_KEEP = 2  # the newest that many stay there; each is a whole step's data


def dcp_data_complete(path: str) -> bool:
    """True if `path` holds DCP's ``.metadata`` (written once every rank's shards are) and every
    byte range it names lies inside its shard file."""
    from hymo_recipes.titan.preflight import check_dcp_checkpoint

    if not _has(path, ".metadata"):
        return False
    try:
        check_dcp_checkpoint(path)
    except ValueError:
        return False
    return True


def set_aside(path: str) -> str:
    """Moves the step folder `path` to ``unfinished/<name>.unfinished-<time>`` beside it (a
    rename: no copy, no space needed) and returns the new path."""
    parent = os.path.join(os.path.dirname(path), UNFINISHED)
    os.makedirs(parent, exist_ok=True)
    base = os.path.join(parent, f"{os.path.basename(path)}.unfinished-{time.strftime('%Y%m%d-%H%M%S')}")
    dest, n = base, 1
    while os.path.exists(dest):
        dest, n = f"{base}-{n}", n + 1
    os.rename(path, dest)
    _prune_set_aside(parent)
    return dest


def _set_aside_order(name: str) -> tuple[str, int]:
    """(time, same-second counter) of a set-aside folder's name, to order by when it was moved."""
    m = re.search(r"\.unfinished-(\d{8}-\d{6})(?:-(\d+))?$", name)
    return (m.group(1), int(m.group(2) or 0)) if m else ("", 0)


def _prune_set_aside(parent: str) -> None:
    """Keeps the newest UNFINISHED_KEEP set-aside saves: each holds a whole step's data, and a run
    preempted during its saves again and again would otherwise fill the disk with them."""
    names = sorted(os.listdir(parent), key=_set_aside_order)
    for name in names[:-UNFINISHED_KEEP]:
        logger.warning(f"removing {os.path.join(parent, name)}: only the newest {UNFINISHED_KEEP} unfinished saves "
                       "are kept")
        shutil.rmtree(os.path.join(parent, name))


def clear_unfinished(path: str) -> None:
    """Clears the unfinished save in `path` (marker, no manifest): moved aside if its DCP data is
    complete (only its manifest is missing), else removed; one warning line says which and where."""
    step = os.path.basename(path).removeprefix("step-")
    if dcp_data_complete(path):
        dest = set_aside(path)
        logger.warning(f"moved {path} to {dest}: a save that did not finish (no {MANIFEST}) but whose DCP data is "
                       f"complete; resume and keep_latest_k do not see it there (to load it, move it back to "
                       f"{os.path.basename(path)} and pass --checkpoint.load_step {step}: unchecked)")
    else:
        logger.warning(f"removing {path}: a save that did not finish (no {MANIFEST}; its DCP data is incomplete)")
        shutil.rmtree(path)


def resume_hint(earlier: list[int]) -> str:
    return (f"resume from an earlier step with --checkpoint.load_step {earlier[-1]} (whole: "
            f"{', '.join(map(str, earlier))}), or move the folder away" if earlier
            else "move the folder away to start afresh")


def _sizes_match(path: str) -> bool:
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            files = json.load(f)["files"]
        return all(os.path.getsize(os.path.join(path, n)) == r["size"] for n, r in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def whole_earlier(plan: ResumePlan) -> list[int]:
    """plan.earlier without the steps whose files no longer have their manifest's sizes."""
    folder = plan.folder
    return [s for s in plan.earlier
            if not _has(os.path.join(folder, f"step-{s}"), MANIFEST) or _sizes_match(os.path.join(folder, f"step-{s}"))]


def check_manifest(path: str, config, earlier: list[int], share: tuple[int, int] | None = (0, 1)) -> None:
    """Raises ValueError with one line if the checkpoint in `path` was written for another
    tokenizer, flavor, shape or muP base width, or if a file it lists is missing, of another size or
    of other bytes. The bytes are read for the files of ``share`` = (rank, ranks): every
    ranks-th file of the sorted list from the rank-th on, so that the ranks of a run read the
    checkpoint once between them, in parallel; None reads none."""
    hint = resume_hint(earlier)
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"checkpoint {path} is damaged: its {MANIFEST} cannot be read ({e!r}); {hint}") from None
    theirs, ours = manifest.get("identity"), run_identity(config)
    if theirs and ours:
        t, o = theirs["tokenizer"], ours["tokenizer"]
        if t["sha256"] != o["sha256"] or t["vocab_size"] != o["vocab_size"]:
            raise ValueError(f"checkpoint {path} was trained with tokenizer {t['sha256']} (vocab {t['vocab_size']}, "
                             f"from {t.get('path')}), this run has {o['sha256']} (vocab {o['vocab_size']}, from "
                             f"{o['path']}): point --model.hf_assets_path at the original or start a new dump folder")
        if theirs["flavor"] != ours["flavor"]:
            raise ValueError(f"checkpoint {path} was trained with flavor {theirs['flavor']!r}, this run builds "
                             f"{ours['flavor']!r}: resume with --model.flavor {theirs['flavor']} or start a new dump folder")
        diffs = [f"{k} {theirs['shape'].get(k)} vs {v}" for k, v in ours["shape"].items() if theirs["shape"].get(k) != v]
        if diffs:
            raise ValueError(f"checkpoint {path} holds a {theirs['flavor']} model of another shape than this run's "
                             f"({', '.join(diffs)}; checkpoint vs run): resume with the settings it was trained with "
                             "([hymo] vocab_size included) or start a new dump folder")
        if (t_mup := manifest_mup_base_width(theirs)) != (o_mup := ours["mup_base_width"]):
            raise ValueError(f"checkpoint {path} was trained with {describe_mup(t_mup)}, this run has "
                             f"{describe_mup(o_mup)}: resume with --hymo.mup_base_width {t_mup} ([hymo] "
                             "mup_base_width in the TOML) or start a new dump folder")
    for name, record in sorted(files.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise ValueError(f"checkpoint {path} is damaged: {name} is missing; {hint}")
        if (size := os.path.getsize(file)) != record["size"]:
            raise ValueError(f"checkpoint {path} is damaged: {name} has {size:,} bytes, its {MANIFEST} says "
                             f"{record['size']:,}; {hint}")
    if share is None:
        return
    rank, ranks = share
    names = sorted(files)[rank::ranks]
    with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:  # zlib drops the GIL
        crcs = dict(zip(names, pool.map(lambda n: file_crc32(os.path.join(path, n)), names)))
    for name in names:
        if crcs[name] != files[name]["crc32"]:
            raise ValueError(f"checkpoint {path} is damaged: {name} does not match its checksum in {MANIFEST} "
                             f"(crc32 {crcs[name]}, recorded {files[name]['crc32']}); {hint}")


# -- saving ------------------------------------------------------------------------------------

def _disk_full(exc: BaseException, folder: str) -> str | None:
    """'disk full' if the exception (its causes, contexts and DCP's per-rank failures included)
    comes from a full disk or an exceeded quota; None otherwise."""
    seen, stack, short_write = set(), [exc], False
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return "disk full"
        text = str(e)
        if "No space left on device" in text or "Disk quota exceeded" in text:
            return "disk full"
        short_write |= "unexpected pos" in text  # PyTorchStreamWriter's short write
        stack += [e.__cause__, e.__context__]
        for failure in (getattr(e, "failures", None) or {}).values():  # DCP's CheckpointException
            stack.append(failure[0] if isinstance(failure, tuple) else failure)
    if short_write:  # what a rank sees of another rank's full disk: the OSError does not cross ranks
        free = shutil.disk_usage(folder).free if os.path.isdir(folder) else 0
        return "disk full" if free < 64 << 20 else f"disk full or over quota (a short write; {free >> 20:,} MiB free there)"
    return None


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class SaveGuard:
    """Manifests, the resume choice, full disks and signals on one Trainer (module docstring)."""

    def __init__(self, trainer, config):
        self.trainer, self.config = trainer, config
        self.ck = trainer.checkpointer
        self.identity = run_identity(config)
        self.signal: int | None = None
        self.stopped_at: int | None = None
        self.saved_steps: set[int] = set()  # whole checkpoints this run wrote (the same on every rank)
        self.on_signal = bool(getattr(getattr(config, "hymo", None), "checkpoint_on_signal", False))

    def install(self) -> SaveGuard:
        ck = self.ck
        if not getattr(ck, "enable", False):
            return self
        self._save = ck.save
        ck.save = self.save
        self.trainer.save_guard = self  # for the train step's stop when the data runs out
        plan = plan_resume(ck.folder, -1)
        chosen = -1 if plan is None or plan.target is None else plan.target
        find = ck._find_load_step
        ck._find_load_step = lambda folder="": chosen if not folder or folder == ck.folder else find(folder)
        if self.on_signal and not ck.load_only:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._on_signal)
            should_continue = self.trainer.should_continue_training
            self.trainer.should_continue_training = lambda: self.stopped_at is None and should_continue()
        return self

    def _on_signal(self, signum, frame) -> None:
        if self.signal is None:
            self.signal = signum
            logger.warning(f"{signal.Signals(signum).name} received: saving a checkpoint at the end of this step, "
                           "then stopping ([hymo] checkpoint_on_signal)")

    def _agree(self, flag: int) -> int:
        """The largest `flag` over the ranks (so they stop after the same step)."""
        import torch
        import torch.distributed as dist

        if _rank_and_world()[1] == 1:
            return flag
        t = torch.tensor([flag], dtype=torch.int32, device=self.trainer.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _from_rank0(self, value):
        import torch.distributed as dist

        if _rank_and_world()[1] == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def save(self, curr_step: int, last_step: bool = False) -> None:
        ck = self.ck
        stop = self.on_signal and not ck.load_only and self._agree(int(self.signal is not None))
        regular = ck._should_save(curr_step, last_step)
        if regular or stop:
            self._guarded_save(curr_step, last_step, force=not regular)
        if stop:
            self.stopped_at = curr_step
            name = signal.Signals(self.signal).name if self.signal else "a signal on another rank"
            note = (f"hymo: stopped by {name} after step {curr_step}: checkpoint {ck._create_checkpoint_id(curr_step)} "
                    "saved; start the same command again to resume from it")
            logger.warning(note)
            leave_note(note)

    def stop_before(self, step: int, resumed_from: int = 0) -> str | None:
        """Checkpoints step ``step - 1`` because step ``step`` cannot run (the trainer's step
        counter already rewound to it; model, optimizers and schedules are at its end, the data
        position past the reads of step ``step``); says what was saved, None when nothing was.
        A step this run saved or resumed from (``resumed_from``) is left as it is: decided from
        this run's own history, the same on every rank, not from what a rank sees on disk."""
        ck, last = self.ck, step - 1
        if ck.load_only:
            return None
        path = ck._create_checkpoint_id(last)
        if last in self.saved_steps or (last == resumed_from and last >= 1):
            return f"checkpoint {path} (step {last}) is on disk"
        if last < 1:
            return None
        self._guarded_save(last, False, force=True)
        return f"checkpoint {path} (step {last}) saved"

    def _previous(self, step: int) -> str:
        plan = plan_resume(self.ck.folder, -1)  # the failed step has its marker: never the target
        if plan is None or plan.target is None or plan.target == step:
            return "there is no earlier checkpoint"
        return f"the previous checkpoint (step {plan.target}) is kept"

    def _guarded_save(self, step: int, last_step: bool, force: bool) -> None:
        resolve = getattr(getattr(self.trainer, "optimizers", None), "resolve", None)
        if resolve is not None:
            # a replayed optimizer step's NaN verdict read before anything is written: a stop
            # at the guard's limit then comes before this save starts, not inside it
            resolve()
        ck, (rank, world) = self.ck, _rank_and_world()
        path = ck._create_checkpoint_id(step)
        error = None
        if rank == 0:
            try:
                for other in unfinished_saves(ck.folder):
                    # skipped by a resume, and TorchTitan's keep_latest_k would count it among the
                    # checkpoints it keeps, deleting a whole one instead
                    clear_unfinished(other)
                if os.path.isdir(path):
                    logger.warning(f"replacing {path}, left by an earlier run (a step the resume did not load)")
                    shutil.rmtree(path)
                os.makedirs(path)
                with open(os.path.join(path, SAVING), "w") as f:
                    f.write(json.dumps({"pid": os.getpid(), "started": time.time()}) + "\n")
            except OSError as e:
                error = self._failure(e, step) or f"cannot prepare {path}: {e}"
        if error := self._from_rank0(error):
            raise CheckpointSaveError(error)
        try:
            if force:  # a save at a step TorchTitan would not save at: the full state, not the last-step form
                ck._should_save = lambda *args, **kwargs: True
                try:
                    self._save(step, False)
                finally:
                    del ck._should_save
            else:
                self._save(step, last_step)
            mine = self._checksums(path, rank, world)
        except (Exception, _checkpoint_exception()) as e:
            if message := self._failure(e, step):
                logger.error(message)
                raise CheckpointSaveError(message) from None
            raise
        error = self._write_manifest(path, step, world, mine)
        if error := self._from_rank0(error):
            logger.error(error)
            raise CheckpointSaveError(error)
        self.saved_steps.add(step)

    def _failure(self, e: BaseException, step: int) -> str | None:
        reason = _disk_full(e, self.ck.folder)
        return reason and f"{reason} while saving step {step} to {self.ck.folder}: {self._previous(step)}"

    def _checksums(self, path: str, rank: int, world: int) -> dict:
        """{file: {size, crc32}} of the files of `path` this rank owns: the shards it wrote; rank 0
        also the rest (.metadata)."""
        mine = {}
        for name in sorted(os.listdir(path)):
            if name in (SAVING, MANIFEST) or name.endswith(".tmp"):
                continue
            if not os.path.isfile(os.path.join(path, name)):  # DCP's HF writer leaves its per-rank shards in sharded/
                continue
            m = re.match(r"__(\d+)_", name)
            owner = int(m.group(1)) if m and int(m.group(1)) < world else 0
            if owner == rank:
                file = os.path.join(path, name)
                mine[name] = {"size": os.path.getsize(file), "crc32": file_crc32(file)}
        if world == 1:
            return mine
        import torch.distributed as dist

        every = [None] * world
        dist.all_gather_object(every, mine)
        return {k: v for part in every for k, v in part.items()}

    def _write_manifest(self, path: str, step: int, world: int, files: dict) -> str | None:
        """Rank 0 writes the manifest (temporary file, then rename) and removes the marker;
        returns a message if that failed."""
        if _rank_and_world()[0] != 0:
            return None
        manifest = {"format": FORMAT, "step": step, "world_size": world, "written": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "identity": self.identity, "files": files}
        tmp = os.path.join(path, MANIFEST + ".tmp")
        try:
            with open(tmp, "w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(path, MANIFEST))
            os.remove(os.path.join(path, SAVING))
            dir_fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as e:
            return self._failure(e, step) or f"cannot write {os.path.join(path, MANIFEST)}: {e}"
        return None


STOP_NOTE_FILE = "HYMO_STOP_NOTE_FILE"  # set by scripts/launch.py: where rank 0 notes why the run stopped early


def leave_note(line: str) -> None:
    """Rank 0 leaves ``line`` for the launcher (scripts/launch.py) to print last."""
    if _rank_and_world()[0] == 0 and (path := os.environ.get(STOP_NOTE_FILE)):
        with open(path, "a") as f:
            f.write(line + "\n")


def _checkpoint_exception():
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    return CheckpointException
