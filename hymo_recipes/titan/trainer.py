"""TorchTitan's Trainer with a train step that never makes the host wait for the GPU to move data.

TorchTitan 0.2.2's ``train_step`` moves each microbatch with a blocking ``tensor.to(device)``:
a pageable host-to-device copy that synchronises the stream, so the host waits for the GPU to
finish the previous microbatch's backward before it may launch the next forward, and the GPU
then idles while the host catches up (the forward of a model of many small blocks is
host-bound). ``HymoTrainer.train_step`` is that method with the copies made from pinned memory
with ``non_blocking=True``, in stream order, so the host runs ahead; everything else (token
count, gradient accumulation, clipping, the optimizer and scheduler steps, the logged metrics) is
TorchTitan's code unchanged. On the CPU the moves are plain ``to`` calls, as before. The
batches arrive prepared (``batch_generator``): with ``[hymo] document_masking`` each
microbatch's document boundaries added on the host, before the copy
(hymo_recipes/titan/documents.py), and on the GPU pinned; with ``[hymo] data_prefetch`` (on by
default) read and prepared on a thread one optimizer step ahead, one batch per microbatch
launched, so the GPU does not wait for the host to read a step's microbatches
(hymo_recipes/titan/prefetch.py). With ``[hymo]
fsdp_sync_once_per_step`` (or ``fsdp_units = "auto"`` on one rank: parallelize.fsdp_plan) FSDP
reduce-scatters and reshards after a step's last microbatch only.
With the model's ``fused_loss_chunk`` > 0 the labels go to the model too, which then returns the
heads' cross-entropy sums instead of their logits (hymo_recipes/model/linear_ce.py).

Data that runs out during a step's reads (a streamed dataset without ``[hymo]
allow_data_repeat``, on any rank) stops the run before the step computes anything: the ranks
agree on it (one all-reduce per step when there are several and the data is streamed without
looping; a sized or looping dataset needs none), the step is not trained, the
last whole step is checkpointed (checkpoints.SaveGuard.stop_before) and one line says what
happened and what to do.
"""

from __future__ import annotations

import functools
import time
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from hymo_recipes.titan import checkpoints, documents
from hymo_recipes.titan.api import IGNORE_INDEX, DataloaderExhaustedError, Trainer, dist_utils, logger
from hymo_recipes.titan.dataloader import DataRanOut, HymoDataloader, HymoTextDataset
from hymo_recipes.titan.parallelize import data_parallel_ranks, fsdp_plan
from hymo_recipes.titan.prefetch import Prefetcher


def data_can_run_out(dataloader) -> bool:
    """Whether the training data may end before the run does: not for a dataset that loops
    (``[hymo] allow_data_repeat``) or a map-style one, whose every rank's shard the preflight
    sized against the run (data_checks.py). Only then do the ranks agree on it each step (a
    collective and a host read), the same answer on every rank."""
    ds = getattr(dataloader, "dataset", None)
    if isinstance(ds, HymoTextDataset):
        return not ds.allow_repeat and not ds.map_style
    return True


class HymoTrainer(Trainer):
    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda" and t.device.type == "cpu":
            # pinned (the caching host allocator reuses the block once the copy has run); the
            # batches arrive pinned (_prepare_batch), for which pin_memory returns the tensor itself
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    _start_step: int | None = None
    _data_can_run_out = True
    _prefetcher: Prefetcher | None = None

    def _prepare_batch(self, split, batch):
        """A batch as the train step takes it: its documents' boundaries added (``split``, None
        without document masking) and, for the GPU, its tensors pinned."""
        input_dict, labels = batch
        if split is not None:
            input_dict.update(split(input_dict["input"]))
        if self.device.type == "cuda":
            input_dict = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in input_dict.items()}
            labels = labels.pin_memory()
        return input_dict, labels

    def batch_generator(self, data_iterable: Iterable) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        """TorchTitan 0.2.2's batch_generator (tokens seen, data-loading time, the end of the data
        as DataloaderExhaustedError) yielding prepared batches (``_prepare_batch``). With
        ``[hymo] data_prefetch`` and HyMo's dataloader they are read and prepared on a thread one
        optimizer step ahead, one batch per microbatch that train_step launches
        (hymo_recipes/titan/prefetch.py), the checkpoint keeping the position of the batches
        taken here; the data-loading time is then the wait for a
        prepared batch (without it, the reading and preparing)."""
        split = documents.splitter(self.job_config, self.tokenizer)
        prepare = functools.partial(self._prepare_batch, split)
        hymo = getattr(self.job_config, "hymo", None)
        loader = data_iterable if isinstance(data_iterable, HymoDataloader) else None
        if loader is not None and getattr(hymo, "data_prefetch", True):
            # a step's microbatches ready, and the next one in hand
            on_start = (lambda: torch.cuda.set_device(self.device)) if self.device.type == "cuda" else None
            batches = Prefetcher(loader, prepare, loader.live_state, max(1, self.gradient_accumulation_steps),
                                 on_start=on_start, paced=True)
            self._prefetcher = batches  # train_step grants it one batch per microbatch launched
        else:
            batches = ((prepare(batch), None) for batch in data_iterable)
        try:
            while True:
                start = time.perf_counter()
                try:
                    (input_dict, labels), position = next(batches)
                except StopIteration as ex:
                    # data that ends within a step's microbatches: the step is not trained
                    raise DataloaderExhaustedError() from ex
                if position is not None:
                    loader.consumed = position
                ntokens = labels.numel()
                self.ntokens_seen += ntokens
                self.metrics_processor.ntokens_since_last_log += ntokens
                self.metrics_processor.data_loading_times.append(time.perf_counter() - start)
                yield input_dict, labels
        finally:
            if self._prefetcher is batches:
                self._prefetcher = None
            batches.close()

    def _sync_gradients(self, last: bool) -> None:
        """FSDP's reduce-scatter and reshard after this microbatch's backward only if ``last``."""
        for part in self.model_parts:
            if not isinstance(part, FSDPModule):
                raise ValueError("[hymo] fsdp_sync_once_per_step needs the model under FSDP2 (HyMo's "
                                 "parallelize applies it at every process count)")
            part.set_requires_gradient_sync(last)
            part.set_reshard_after_backward(last)

    def _rank_where(self, flag: bool) -> int | None:
        """The highest rank where ``flag`` holds, or None (every rank calls this once per step)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return 0 if flag else None
        t = torch.tensor([dist.get_rank() + 1 if flag else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        where = int(t.item())
        return where - 1 if where else None

    def _stop_for_data(self, rank: int) -> None:
        """The data ran out on ``rank`` (the highest such) while this step's microbatches were
        read: checkpoint the last whole step, say so, end the training loop. The sequences read
        for the untrained step count as read (in the data position and the token count): at most
        one step of the data's last sequences is never trained."""
        several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        why = f"dataset {self.job_config.training.dataset} ran out{f' on rank {rank}' if several else ''}"
        step = self.step
        self.step = step - 1  # this step is not trained: the checkpoint is the step before it
        guard = getattr(self, "save_guard", None)
        saved = guard.stop_before(step, self._start_step - 1) if guard is not None else None
        if saved is None:
            tail = ("nothing saved (checkpointing is off or load-only, or no step was trained). Add data, lower "
                    "--training.steps or pass --hymo.allow_data_repeat")
        else:
            tail = (f"{saved}. Add data, lower --training.steps or pass --hymo.allow_data_repeat, then start the "
                    "same command again to resume")
        note = f"hymo: the training data ran out during step {step} ({why}); step {step} was not trained; {tail}"
        logger.warning(note)
        checkpoints.leave_note(note)
        raise DataloaderExhaustedError(note)

    def train_step(self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]):
        # TorchTitan 0.2.2's Trainer.train_step but for _to_device (the batches come prepared:
        # batch_generator), the stop when the data runs out, FSDP's once-per-step gradient sync
        # and the labels passed to the model for the fused loss
        if self._start_step is None:
            self._start_step = self.step  # the first step this process trains (a resume's loaded step + 1)
            self._data_can_run_out = data_can_run_out(self.dataloader)
        self.optimizers.zero_grad()
        parallel_dims = self.parallel_dims

        microbatches = []
        local_valid_tokens = torch.tensor(0, dtype=torch.int64)
        ran_out = False
        for _microbatch in range(self.gradient_accumulation_steps):
            try:
                input_dict, labels = next(data_iterator)
            except (DataRanOut, DataloaderExhaustedError):
                if not self._data_can_run_out:
                    raise  # a sized dataset the preflight passed: not a case the ranks agree on
                ran_out = True
                break
            local_valid_tokens += (labels != IGNORE_INDEX).sum()
            microbatches.append((input_dict, labels))
        if self._data_can_run_out and (rank := self._rank_where(ran_out)) is not None:
            self._stop_for_data(rank)

        local_valid_tokens = self._to_device(local_valid_tokens)
        if parallel_dims.dp_enabled:
            batch_mesh = parallel_dims.get_mesh("batch")
            global_valid_tokens = dist_utils.dist_sum(local_valid_tokens, batch_mesh)
        else:
            global_valid_tokens = local_valid_tokens.float()

        accumulated_losses = []
        hymo = getattr(self.job_config, "hymo", None)
        if self.job_config.model.name == "hymo":  # HyMo's parallelize applied the same plan
            sync_once = fsdp_plan(hymo, data_parallel_ranks(parallel_dims))[1]
        else:
            sync_once = bool(getattr(hymo, "fsdp_sync_once_per_step", False))
        fused_loss = getattr(self.model_args, "fused_loss_chunk", 0) > 0
        for i, (input_dict, labels) in enumerate(microbatches):
            if sync_once:
                self._sync_gradients(last=i == len(microbatches) - 1)
            for k, v in input_dict.items():
                if isinstance(v, torch.Tensor):
                    input_dict[k] = self._to_device(v)
            labels = self._to_device(labels)
            if fused_loss:  # the model computes the heads' cross-entropy itself (model/linear_ce.py)
                input_dict["labels"] = labels
            loss = self.forward_backward_step(input_dict=input_dict, labels=labels,
                                              global_valid_tokens=global_valid_tokens)
            accumulated_losses.append(loss.detach())
            if self._prefetcher is not None:  # one batch of the next step read while this one runs
                self._prefetcher.grant()

        grad_norm = dist_utils.clip_grad_norm_(
            [p for m in self.model_parts for p in m.parameters()],
            self.job_config.training.max_norm,
            foreach=True,
            pp_mesh=parallel_dims.get_optional_mesh("pp"),
            ep_enabled=parallel_dims.ep_enabled,
        )
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        # this step's lr: read after the optimizers' step, which takes the schedule's step owed
        # to a replayed step read late (hymo_recipes/titan/optimizers.py)
        lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]
        self.lr_schedulers.step()

        loss = torch.sum(torch.stack(accumulated_losses))
        logged = self.metrics_processor.should_log(self.step)
        resolve = getattr(self.optimizers, "resolve", None)
        if resolve is not None and (logged or self.step >= self.job_config.training.steps):
            # a replayed step's NaN verdict, else read at the next step: into the logged counters
            # (the log syncs anyway), and at the last step, where no next step reads it
            resolve()
        if not logged:
            return

        if parallel_dims.dp_cp_enabled:
            loss = loss.detach()
            loss_mesh = parallel_dims.get_optional_mesh("loss")
            local_avg_loss = loss * global_valid_tokens / local_valid_tokens
            global_avg_loss, global_max_loss, global_ntokens_seen = (
                dist_utils.dist_sum(loss, loss_mesh),
                dist_utils.dist_max(local_avg_loss, loss_mesh),
                dist_utils.dist_sum(torch.tensor(self.ntokens_seen, dtype=torch.int64, device=self.device),
                                    loss_mesh),
            )
        else:
            global_avg_loss = global_max_loss = loss.detach().item()
            global_ntokens_seen = self.ntokens_seen

        self.metrics_processor.log(
            self.step,
            global_avg_loss,
            global_max_loss,
            grad_norm.item(),
            extra_metrics={"n_tokens_seen": global_ntokens_seen, "lr": lr},
        )
