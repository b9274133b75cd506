"""One rank of a training run: ``python -m megacore.train --config recipe.json``.

Executors start this on every rank (``megacore.launch``, srun, a PyTorchJob pod). It reads the recipe, joins
the world communicator, builds this rank's data sources, hands everything to the C++ ``Trainer`` and, when the
recipe asks for it, prints a greedy sample from the trained model on rank 0. Rank 0 also writes the recipe
next to the logs, so the run can be reproduced from its own config.

Failures and signals (docs/training.md, "Failures, signals and restarts"): any exception on a rank ends the
whole job at once (fail_fast: the error is printed and recorded for the launcher, the world communicator is
aborted, MPI_Abort under mpirun); SIGTERM, SIGUSR1 or a first Ctrl-C stop every rank after the same step with a
checkpoint and exit 0.
"""

from __future__ import annotations

import argparse
import os
import sys

from .errors import ConfigError


def build_data(recipe, world):
    """(train, valid) sample sources of this rank. Rank 0 writes shared files (the embedded corpus, dataset
    index caches) first; the other ranks read them after a barrier, so no two ranks write the same file."""
    from . import data as mdata

    d, t = recipe.data, recipe.trainer
    run_dir = os.path.dirname(recipe.logging.log_dir.rstrip("/")) if recipe.logging.log_dir else os.path.join(
        "runs", recipe.name)
    cache = d.cache_dir or os.path.join(run_dir, "data")
    train_samples = t.max_steps * d.global_batch_size
    valid_samples = t.limit_val_batches * d.global_batch_size if t.val_check_interval > 0 else 0

    def build():
        if d.sft_path:
            # Packed rows carry their boundaries (Batch.cu_seqlens) and restarting positions; the trainer
            # hands them to every pipeline stage, so no example attends to another. data.split cuts the
            # examples into training and validation parts (validation only when the trainer validates).
            from .data.sft import build_sft_datasets

            split = d.split if t.val_check_interval > 0 else "1,0,0"
            return build_sft_datasets(d.sft_path, d.tokenizer, d.seq_length, pack=d.sft_pack, split=split,
                                      seed=d.seed, on_error=d.sft_on_error)
        paths = d.paths
        if list(paths) == ["embedded"]:
            os.makedirs(cache, exist_ok=True)
            paths = [mdata.default_corpus(cache, d.embedded_documents, d.seed)]
        cfg = mdata.PretrainData(paths=paths, seq_length=d.seq_length, global_batch_size=d.global_batch_size,
                                 micro_batch_size=d.micro_batch_size, split=d.split, seed=d.seed, cache_dir=cache)
        train, valid, _ = cfg.datasets(train_samples, valid_samples)
        return train, valid

    if world.rank == 0:
        out = build()
        world.barrier()
    else:
        world.barrier()
        out = build()
    return out


def _restart_count() -> int:
    """Which restart of the job this attempt is (MEGACORE_RESTART, set by megacore.launch; 0: the first attempt)."""
    return int(os.environ.get("MEGACORE_RESTART", "0") or 0)


def _metrics_server(lg):
    """The Prometheus endpoint of logging.metrics_host:metrics_port; ConfigError naming the fields when it cannot
    listen there (the port taken, an address not of this machine)."""
    from .metrics import MetricsServer

    try:
        server = MetricsServer(lg.metrics_host, lg.metrics_port, restarts=_restart_count())
    except OSError as e:
        raise ConfigError(f"logging.metrics_port: cannot serve metrics on {lg.metrics_host}:{lg.metrics_port} "
                          f"({e.strerror or e}); choose a free port (or 0 to turn the endpoint off), or a "
                          "logging.metrics_host this machine has") from None
    print(f"megacore: metrics at http://{lg.metrics_host}:{lg.metrics_port}/metrics", flush=True)
    return server


def run(recipe, world=None, on_step=None, on_world=None) -> dict:
    """Trains `recipe` on this rank (collective over the world); returns the C++ trainer's result dict.
    `on_step(metrics)` runs on every rank after each step (an exception it raises ends the run);
    `on_world(world)` is told the world communicator as soon as it exists (main aborts it on an error)."""
    from . import _C, _proc, comm, tokenizers

    if recipe.data.tokenizer != "byte" and os.path.exists(recipe.data.tokenizer):
        # The recipe saved with every checkpoint names the tokenizer by absolute path, so an export or a
        # resume from another working directory finds it.
        recipe.data.tokenizer = os.path.abspath(recipe.data.tokenizer)
    recipe.validate()
    if world is None:
        dev = {"auto": "auto", "cpu": "cpu", "cuda": "cuda:0"}[recipe.trainer.device]
        world = comm.init_from_env(device=dev, timeout_s=recipe.trainer.comm_timeout_s)
    if on_world is not None:
        on_world(world)
    if world.size != recipe.world_size:
        raise ConfigError(f"the recipe is for {recipe.world_size} ranks (resources: {recipe.resources.num_nodes} × "
                          f"{recipe.resources.num_gpus_per_node}) but {world.size} were started; launch "
                          f"{recipe.world_size} ranks or change resources")
    if world.backend == "nccl":
        _check_gpu_memory(recipe, world)
    if world.rank == 0 and recipe.logging.log_dir:
        os.makedirs(recipe.logging.log_dir, exist_ok=True)
        recipe.to_json(os.path.join(recipe.logging.log_dir, "recipe.json"))
    # The metrics endpoint first (rank 0): a port it cannot take is said before the data and the model are built.
    server = _metrics_server(recipe.logging) if world.rank == 0 and recipe.logging.metrics_port else None
    try:
        train, valid = build_data(recipe, world)
        cfg = _C.train.RunConfig.from_json(recipe.to_json())
        trainer = _C.train.Trainer(cfg, world, train, valid)
    except BaseException:
        if server is not None:
            server.close()
        raise
    if world.rank == 0:
        _proc.report_progress(trainer.step)

    def step_done(m):
        if world.rank == 0:
            _proc.report_progress(m["step"])
            if server is not None:
                server.update(m)
        if on_step is not None:
            on_step(m)
    trainer.set_step_callback(step_done)
    try:
        result = trainer.fit()
    finally:
        trainer.set_step_callback(None)
        if server is not None:
            server.close()
    hist = result["history"]
    if world.rank == 0 and hist:
        first = hist[0]["loss"]
        last = hist[-1]["loss"]
        print(f"trained steps {result['start_step'] + 1}..{result['final_step']}: loss {first:.4f} -> {last:.4f}"
              + (f"; checkpoint {result['last_checkpoint']}" if result["last_checkpoint"] else ""), flush=True)
    n = recipe.trainer.generate_tokens
    if n > 0 and not result["stopped_by_signal"]:
        tok = tokenizers.load_tokenizer(recipe.data.tokenizer)
        prompt = tok.encode(recipe.trainer.generate_prompt or " ")
        ids = trainer.generate(prompt, n)
        result["generated"] = ids
        if world.rank == 0:
            print(f"sample: {recipe.trainer.generate_prompt!r} -> {tok.decode(ids)!r}", flush=True)
    return result


def _check_gpu_memory(recipe, world) -> None:
    """trainer.memory_check against this rank's GPU, before anything is built (on cluster nodes the first look at
    their GPUs; a local launcher has already checked); rank 0 prints plan's estimate beside the GPU's memory, to be
    compared with the step log's measured peak. Every rank reaches the same verdict, so all of them fail together."""
    from . import _C, cli

    if recipe.trainer.memory_check == "off":
        return
    local = int(os.environ.get("LOCAL_RANK") or os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK") or 0)
    quiet = world.rank != 0 or os.environ.get(cli.MEMORY_CHECKED_ENV) == "1"
    c = cli.enforce_memory_check(recipe, cli.gpu_memory_gib([local % max(1, _C.cuda_device_count())]),
                                 warn=(lambda m: None) if quiet else None)
    if c is not None and world.rank == 0:
        print(f"megacore: {c['summary']}", flush=True)


def _restart_resume(recipe) -> None:
    """A job the launcher restarted (MEGACORE_RESTART=n) resumes from the latest checkpoint under its
    checkpoint.save_dir, unless checkpoint.resume names a newer one (the first attempt resumed from that path and
    has saved nothing since). With no checkpoint under save_dir it starts as the first attempt did, and rank 0 says
    so: the steps since are trained again."""
    from . import _proc
    from .checkpoint import checkpoint_step, resolve_checkpoint
    from .errors import IOError as MegacoreIOError

    n = _restart_count()
    c = recipe.checkpoint
    if n <= 0:
        return
    given = resolve_checkpoint(c.resume) if c.resume not in ("", "auto") else None
    try:
        saved = resolve_checkpoint(c.save_dir) if c.save_dir else None
    except MegacoreIOError:  # a damaged newest checkpoint under save_dir
        if given is None:
            raise
        saved = None  # the checkpoint the user named instead (the damaged one's error suggests exactly that)
    if saved is not None:
        # The newer of the two: a save_dir that held older checkpoints of another run does not take a restart back.
        if given is None or checkpoint_step(saved) >= checkpoint_step(given):
            c.resume = "auto"
        return
    if _proc.rank_from_env() == 0:
        start = f"checkpoint.resume = '{c.resume}'" if c.resume not in ("", "auto") else "step 0"
        sys.stderr.write(f"megacore.train: warning: restart {n} finds no complete checkpoint under checkpoint.save_dir "
                         f"= '{c.save_dir}' (moved, deleted, or none saved yet): it starts from {start}\n")
        sys.stderr.flush()


# How long a rank that only passes another rank's failure on (PeerIOError) waits for that rank's own report.
PEER_REPORT_WAIT_S = 5.0


def fail_fast(exc: BaseException, world=None, code: int = 1):
    """Reports `exc` (stderr and the launcher's job folder) and ends the job: this rank's communicators are
    aborted and the process exits with `code` at once (MPI_Abort under mpirun, which then ends every rank;
    under megacore.launch the launcher stops the others). Never returns."""
    import threading
    import traceback

    from . import _proc
    from .errors import Error

    from .errors import PeerIOError

    rank = world.rank if world is not None else _proc.rank_from_env()
    msg = f"{type(exc).__name__}: {exc}".strip().replace("\n", " | ")
    failed_rank = exc.failed_rank if isinstance(exc, PeerIOError) else None
    if not isinstance(exc, Error):  # our errors say what to fix; anything else is worth its traceback
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    # One write of the whole line: the ranks run unbuffered (python -u), and print's separate write of the newline
    # let another rank's line land between them.
    sys.stderr.write(f"megacore.train: rank {rank}: error: {msg}\n")
    sys.stderr.flush()
    _proc.report_error(rank, msg, failed_rank)
    sys.stdout.flush()
    if failed_rank is not None and failed_rank != rank:
        # The rank that failed raises at the same agreement; it reports and aborts within moments. This rank's abort
        # must not end the job before that rank has said why.
        _proc.wait_for_error_report(failed_rank, PEER_REPORT_WAIT_S)
    # An abort that does not return (a driver call stuck on a dead peer) must not keep the job alive.
    threading.Timer(5.0, lambda: os._exit(code)).start()
    if world is not None:
        try:
            world.abort()
        except BaseException:  # noqa: BLE001 - already failing; the exit below is what matters
            pass
    from . import _C

    _C.comm.abort_job(code)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megacore.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="the recipe (JSON or YAML, as Recipe.to_json/to_yaml wrote it)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe field")
    a = ap.parse_args(argv)
    return guarded(lambda on_world: run(_load(a.config, a.set), on_world=on_world))


def _load(config, overrides):
    from .recipes import Recipe

    recipe = Recipe.from_file(config).apply_overrides(overrides)
    _restart_resume(recipe)
    return recipe


def guarded(body) -> int:
    """Runs ``body(on_world)`` as one rank of a job: SIGTERM, SIGUSR1 and a first Ctrl-C stop it after the
    current step with a checkpoint (exit 0); any exception ends the whole job through fail_fast."""
    from . import _C, _proc

    world = []
    _C.train.install_stop_signal_handlers()
    _proc.report_ready(_proc.rank_from_env())  # the launcher holds a stop request back until every rank is here
    try:
        body(world.append)
    except BaseException as e:  # noqa: BLE001 - every failure must end the job, whatever raised it
        if isinstance(e, SystemExit) and e.code in (0, None):
            return 0
        fail_fast(e, world[0] if world else None)
    finally:
        _C.train.uninstall_stop_signal_handlers()
    return 0


if __name__ == "__main__":
    sys.exit(main())
