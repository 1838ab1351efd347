"""Command lines of the coordinator side: fedseq-sim and fedseq-server."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from fedseq.common.config import ExperimentConfig, load_config, load_run_config, run_data_root
from fedseq.common.errors import ConfigError, FedseqError

if TYPE_CHECKING:
    from fedseq.server.rounds.records import RoundRecord

err = Console(stderr=True)

ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="Experiment TOML file.")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override: dotted.key=value (TOML value), repeatable."),
]
OutOpt = Annotated[Path | None, typer.Option("--out", "-o", help="Run directory to write.")]


# Credentials and TLS, the same flags as fedseq-client's.
UsernameOpt = Annotated[str | None, typer.Option(help="broker login (deploy.username)")]
PasswordFileOpt = Annotated[Path | None, typer.Option(
    help="file holding the broker password (deploy.password_file)")]
CaFileOpt = Annotated[Path | None, typer.Option(
    help="mqtts://: PEM file of the CA that signed the broker (deploy.ca_file)")]
CertFileOpt = Annotated[Path | None, typer.Option(
    help="mutual TLS: this side's PEM certificate (deploy.cert_file)")]
KeyFileOpt = Annotated[Path | None, typer.Option(
    help="mutual TLS: the certificate's PEM key (deploy.key_file)")]
NoVerifyOpt = Annotated[bool, typer.Option(
    "--no-verify-hostname", help="accept a broker certificate that does not name its host")]


def _fail(exc: Exception) -> NoReturn:
    print(f"error: {exc}", file=sys.stderr)
    raise typer.Exit(2)


def _interrupted(out: Path, sweep: bool = False, again: str | None = None) -> NoReturn:
    again = again or ("run the same fedseq-sim --seeds command again" if sweep
                      else f"--resume {out}")
    print(f"interrupted: {out} keeps every complete round; continue with {again}",
          file=sys.stderr)
    raise typer.Exit(130)


def _default_out(cfg: ExperimentConfig) -> Path:
    return Path("runs") / f"{cfg.algorithm.name}-{cfg.data.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"


ResumeOpt = Annotated[Path | None, typer.Option(
    help="Continue this run directory after its last complete round (its config.toml, but "
         "data.root is yours: --set data.root, else the default; --set may override only deploy.* "
         "keys and data.root).")]
OverwriteOpt = Annotated[bool, typer.Option(
    "--overwrite", help="Replace the files of an existing, non-empty --out.")]


def _start(config: Path | None, overrides: list[str] | None, out: Path | None,
           resume: Path | None = None, overwrite: bool = False
           ) -> tuple[ExperimentConfig, Path, str, dict[str, Any]]:
    """Logging, the validated config (or a one-line error and exit 2), the run directory, its
    mode (new, overwrite, resume) and what status.json records about the command."""
    from fedseq.common import __version__
    from fedseq.server.rounds.rundir import stop_on_sigterm

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    stop_on_sigterm()  # then exits 130 with the resume line, as on Ctrl-C
    if resume is not None and (config is not None or out is not None or overwrite):
        _fail(ValueError("--resume RUN_DIR takes its config and output folder from RUN_DIR; "
                         "drop --config, --out and --overwrite"))
    try:
        if resume is not None and not (resume / "config.toml").is_file():
            raise ConfigError(f"--resume {resume}: no config.toml there; is it a run directory?")
        if resume is not None:
            cfg = load_run_config(resume, overrides)
            note_data_root(resume, cfg, "--resume")
            if overrides:
                _refuse_result_changes(resume, cfg)
        else:
            cfg = load_config(config, overrides)
    except FedseqError as exc:
        _fail(exc)
    mode = "resume" if resume else "overwrite" if overwrite else "new"
    info = {"package_version": __version__, "command": " ".join(sys.argv)}
    return cfg, resume or out or _default_out(cfg), mode, info


def _refuse_used_out(out: Path, mode: str) -> None:
    """rundir.refuse_used_out before the data loads or a broker or daemon starts (RunDir checks
    it again when it opens the folder)."""
    from fedseq.server.rounds.rundir import refuse_used_out

    try:
        refuse_used_out(out, mode)
    except ConfigError as exc:
        _fail(exc)


def _login_flags(cfg: ExperimentConfig, no_verify_hostname: bool, **flags: Any) -> None:
    """The broker login and TLS flags of start and status over the config's deploy.* keys (a
    flag given wins); a bad value is a one-line error."""
    try:
        for key, value in flags.items():
            if value is not None:
                setattr(cfg.deploy, key, value)
        if no_verify_hostname:
            cfg.deploy.tls_verify_hostname = False
    except ValueError as exc:
        _fail(exc)


def note_data_root(run_dir: Path, cfg: ExperimentConfig, flag: str) -> None:
    """A line on stderr where the run directory's recorded data.root is not the one used."""
    recorded = run_data_root(run_dir)
    if recorded is not None and Path(recorded) != cfg.data.root:
        print(f"note: {flag} reads the data from {cfg.data.root}, not from the run directory's "
              f"data.root {recorded!r} (a run directory never picks its data; pass --set "
              f"data.root='{recorded}' to use that folder)", file=sys.stderr)


def _refuse_result_changes(run_dir: Path, cfg: ExperimentConfig) -> None:
    """--resume continues the run its config.toml describes: a --set that would change its
    results from here on (anything but deploy.* and data.root, seeds.defining) would make the
    run directory describe a run that never happened, so it is refused."""
    from fedseq.server.rounds.seeds import result_changes

    changed = result_changes(load_run_config(run_dir), cfg)
    if changed:
        raise ConfigError(
            f"--resume {run_dir}: --set would change {', '.join(changed)}, which the run's "
            "results depend on; --resume accepts only deploy.* and data.root overrides (other "
            "fine-tuning settings: --finetune-from RUN_DIR --out NEW; anything else: a new run)")


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{100 * v:.2f}%"


#: the documentation site's pages the help names, by their titles in mkdocs.yml's nav (a test
#: keeps the two equal); `page` writes one into a help text
PAGES = {
    "explanation/reproducibility.md": "Seeds and reproducibility",
    "how-to/campaigns.md": "Run a campaign",
    "how-to/scale-out.md": "Scale out",
    "tutorials/own-code.md": "Your own model, data and algorithm",
    "rehearsal.md": "Rehearse a Wi-Fi testbed",
}
EPILOG = ("Documentation: the site built from docs/ (install the docs extra, run mkdocs serve, "
          "open http://127.0.0.1:8000): getting started, tutorials, how-to guides, every "
          "configuration key.")


def with_devices_data(overrides: list[str] | None, devices_data: Path | None) -> list[str]:
    """`overrides` and, with --devices-data DIR, the two that read the simulated devices' folders
    (data.placement = "device", data.devices_root = DIR): fedseq-sim's and `fedseq data stats`'."""
    if devices_data is None:
        return list(overrides or [])
    return [*(overrides or []), 'data.placement="device"',
            f"data.devices_root={json.dumps(str(devices_data.expanduser().resolve()))}"]


def page(path: str) -> str:
    """How a help text names a page of the site: its title and its address there."""
    return f'docs: "{PAGES[path]}", {path.removesuffix(".md")}/'


SeedsOpt = Annotated[str | None, typer.Option(
    help="Run the config under several seeds, e.g. 0,1,2 or 0-4: one run directory per seed, "
         f"OUT/seed-<s>; the same command again continues the sweep "
         f"({page('explanation/reproducibility.md')})")]
VaryOpt = Annotated[str, typer.Option(
    help="With --seeds: the random streams the seed changes, 'all' or some of data (partition, "
         "splits), init (initial weights), selection (clients per round), training (batches, "
         "augmentation); the others stay at the config's value")]


CampaignOpt = Annotated[Path | None, typer.Option(
    help="Run every run of this campaign file (a grid of algorithms, seeds and settings over a "
         "base config) one after another into --out, OUT/<setting>/<algorithm>/seed-<s>; --set "
         f"applies to every run; the same command again continues it "
         f"({page('how-to/campaigns.md')})")]


FinetuneFromOpt = Annotated[Path | None, typer.Option(
    help="Replay the final fine-tuning of this finished simulated run into a new --out, "
         "under other algorithm.finetune_epochs / finetune_blocks (--set); its federated "
         "rounds are reused, not retrained")]
ReplayOpt = Annotated[Path | None, typer.Option(
    help="Re-execute this asynchronous run (train.mode = \"async\", simulated or deployed) "
         "in the order its metrics.jsonl records into a new --out, and say whether the "
         "global model is bitwise the run's (equal threads: --set train.threads=N)")]
WorkersOpt = Annotated[int, typer.Option(
    help="Train the clients in N worker processes (torch.distributed, Gloo), train.threads "
         "each (default 1): the numbers of an in-process run with as many threads; N = "
         "the cores is the fast setting. Under torchrun the group is torchrun's "
         f"({page('how-to/scale-out.md')})", min=0)]
WorkersPerGpuOpt = Annotated[int, typer.Option(
    help="With train.device on GPUs: K workers share each GPU (without --workers: K per GPU "
         "of this machine). Workers fill a machine's GPUs in turn, K to a GPU", min=0)]
DevicesDataOpt = Annotated[Path | None, typer.Option(
    help="Data on the devices (data.placement = 'device'): DIR/<device>/ holds what that "
         "device's fedseq-client --data-dir would, one simulated device per folder "
         f"({page('tutorials/own-code.md')})")]


def _a_worker_rank() -> bool:
    """Under torchrun or srun, a rank other than 0 serves as a worker here (rank 0 runs the
    round loop and writes the run directory): True once it is done. Every process: OpenMP's
    waiting threads sleep instead of spinning (OMP_WAIT_POLICY overrides)."""
    import os

    from fedseq.server.pools.distributed import adopt_slurm_env

    adopt_slurm_env()  # srun's tasks are a group's ranks, as torchrun's are
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and os.environ.get("RANK", "0") != "0":
        from fedseq.server.pools.distributed import worker_main

        worker_main()
        return True
    # Before torch loads OpenMP: waiting threads sleep instead of spinning, so a run that meets
    # other work keeps going (measured beside one busy process, 2 threads: > 200 s per round
    # spinning, 52 s passive; idle: 16.2 s spinning, 19.6 s passive).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return False


def sim(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    out: OutOpt = None,
    resume: ResumeOpt = None,
    overwrite: OverwriteOpt = False,
    seeds: SeedsOpt = None,
    vary: VaryOpt = "all",
    campaign: CampaignOpt = None,
    finetune_from: FinetuneFromOpt = None,
    replay: ReplayOpt = None,
    workers: WorkersOpt = 0,
    workers_per_gpu: WorkersPerGpuOpt = 0,
    devices_data: DevicesDataOpt = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
    version: VersionOpt = False,
) -> None:
    """Run a federated experiment (in one process, or with --workers) and write a run directory."""
    import os

    if _a_worker_rank():
        return
    if campaign is not None:
        if config is not None or resume is not None or seeds is not None or overwrite \
                or replay is not None or finetune_from is not None or out is None:
            _fail(ValueError("--campaign FILE takes the config, the seeds and the grid from FILE "
                             "and needs --out DIR; drop --config, --resume, --seeds, --overwrite, "
                             "--replay and --finetune-from"))
        _campaign_sim(campaign, set_ or [], out, quiet, (workers, workers_per_gpu))
        return
    if seeds is None and vary != "all":
        _fail(ValueError("--vary chooses what --seeds changes; give --seeds too"))
    if seeds is not None and resume is not None:
        _fail(ValueError("--seeds continues a sweep by itself: run the same command again "
                         "(without --resume)"))
    if replay is not None:
        _replay(replay, set_ or [], out, overwrite, quiet, workers,
                config is not None or resume is not None or seeds is not None)
        return
    if finetune_from is not None:
        _finetune_again(finetune_from, set_ or [], out, quiet,
                        config is not None or resume is not None or seeds is not None or overwrite)
        return
    set_ = with_devices_data(set_, devices_data)
    cfg, out, mode, info = _start(config, set_, out, resume, overwrite)
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and mode == "new" \
            and (out / "checkpoint.safetensors").exists():
        mode = "resume"  # torchrun --max-restarts started the group again: continue the run
        _refuse_result_changes(out, cfg)
    if seeds is None:
        _refuse_used_out(out, mode)
        _simulate(cfg, out, mode, info, quiet, (workers, workers_per_gpu))
        _summary(out)
        return
    _sweep(cfg, out, info, seeds, vary, overwrite, quiet, (workers, workers_per_gpu))


def _sweep(cfg: Any, out: Path, info: dict[str, Any], seeds: str, vary: str, overwrite: bool,
           quiet: bool, workers: tuple[int, int]) -> None:
    """fedseq-sim --seeds: one run per seed under OUT/seed-N, each continued, kept (finished) or
    restarted (another config) as its folder says; a line per seed and a closing one."""
    from fedseq.server.rounds.seeds import parse_seeds, parse_vary, seed_config, seed_dir, seed_state

    try:
        todo = [(s, seed_config(cfg, s, parse_vary(vary))) for s in parse_seeds(seeds)]
        states = {s: "overwrite" if overwrite else seed_state(seed_dir(out, s), c) for s, c in todo}
    except FedseqError as exc:
        _fail(exc)
    for s, seed_cfg in todo:
        path, state = seed_dir(out, s), states[s]
        if state == "finished":
            print(f"seed {s}: finished before, kept ({path})", file=sys.stderr)
            continue
        print(f"seed {s}: {state} -> {path}", file=sys.stderr)
        run_mode = {"restart": "overwrite"}.get(state, state)
        _simulate(seed_cfg, path, run_mode, {**info, "sweep": str(out), "vary": vary}, quiet,
                  workers)
        _summary(path)
    print(f"sweep finished: {len(todo)} seeds in {out}  (fedseq report {out})", file=sys.stderr)


def _open_campaign(file: Path, overrides: list[str], out: Path) -> tuple[Any, list[Any], Any]:
    """A campaign's file, its runs and its folder checked against them (fedseq-sim --campaign,
    fedseq-server campaign), or a one-line error (exit 2)."""
    from fedseq.server.ops.campaign import Campaign, load_campaign
    from fedseq.server.rounds.rundir import stop_on_sigterm

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    stop_on_sigterm()
    try:
        spec, runs = load_campaign(file, overrides)
        book = Campaign(out, runs, file)
        book.open(lambda line: print(line, file=sys.stderr))
    except FedseqError as exc:
        _fail(exc)
    return spec, runs, book


def _go_campaign(spec: Any, book: Any, run_one: Any, progress: Any = None) -> None:
    """The campaign's runs in order through `run_one(run, path, mode, info)`, a line per run and
    a closing count; exit 1 where a run failed, 130 on Ctrl-C (the same command continues)."""
    from fedseq.common import __version__

    info = {"package_version": __version__, "command": " ".join(sys.argv)}

    def one(run: Any, path: Path, mode: str, more: dict[str, Any]) -> None:
        run_one(run, path, mode, {**info, **more})
        _summary(path)

    counts = book.go(one, spec.on_failure == "stop", lambda line: print(line, file=sys.stderr),
                     progress)
    print(f"campaign {book.out}: {len(book.runs)} runs: "
          + ", ".join(f"{n} {k}" for k, n in counts.items() if n)
          + f"  (fedseq report {book.out})", file=sys.stderr)
    if counts["failed"]:
        raise typer.Exit(1)


def _campaign_sim(file: Path, overrides: list[str], out: Path, quiet: bool,
                  workers: tuple[int, int]) -> None:
    """fedseq-sim --campaign FILE --out DIR."""
    spec, _, book = _open_campaign(file, overrides, out)
    _go_campaign(spec, book, lambda run, path, mode, info: _simulate(
        run.cfg, path, mode, info, quiet, workers, raises=True))


def _from_run(flag: str, key: str, src: Path, out: Path | None, conflicts: bool,
              drop: str) -> tuple[Path, dict[str, Any]]:
    """The start of a run made from another (`flag` RUN_DIR): stop on SIGTERM, a one-line error
    where options conflict or --out is missing (`drop`: the options to leave out); the new run's
    folder and what its status.json records (`key`: the source run)."""
    from fedseq.common import __version__
    from fedseq.server.rounds.rundir import stop_on_sigterm

    stop_on_sigterm()
    if conflicts or out is None:
        _fail(ValueError(f"{flag} RUN_DIR takes its config from RUN_DIR and needs a new --out; "
                         f"drop {drop}"))
    return out, {key: str(src.resolve()), "package_version": __version__,
                 "command": " ".join(sys.argv)}


def _finetune_again(src: Path, overrides: list[str], out: Path | None, quiet: bool,
                    conflicts: bool) -> None:
    """fedseq-sim --finetune-from SRC --set algorithm.finetune_blocks=head --out NEW."""
    from fedseq.server.rounds.rundir import copy_for_finetune

    out, info = _from_run("--finetune-from", "finetuned_from", src, out, conflicts,
                          "--config, --resume, --seeds and --overwrite")
    try:
        cfg = copy_for_finetune(src, out, overrides, info)
        note_data_root(src, cfg, "--finetune-from")
    except FedseqError as exc:
        _fail(exc)
    _simulate(cfg, out, "resume", info, quiet)
    _summary(out)


def _replay(src: Path, overrides: list[str], out: Path | None, overwrite: bool, quiet: bool,
            workers: int, conflicts: bool) -> None:
    """fedseq-sim --replay RUN_DIR --out NEW: ends with whether the model is bitwise the run's
    (exit 0) or not (exit 1)."""
    from fedseq.server.ops.simulation import replay

    out, info = _from_run("--replay", "replayed_from", src, out, conflicts,
                          "--config, --resume and --seeds")
    try:
        if (src / "config.toml").is_file():
            note_data_root(src, load_run_config(src, overrides), "--replay")
        _, same, verdict = replay(src, out, overrides, workers,
                            on_round=None if quiet else lambda r: print(
                                f"{'step ' + str(r.round) if r.phase == 'train' else r.phase}: "
                                f"global {_fmt(r.global_acc)}, personal {_fmt(r.personal_acc)}",
                                file=sys.stderr),
                            info=info, mode="overwrite" if overwrite else "new")
    except FedseqError as exc:
        _fail(exc)
    except KeyboardInterrupt:
        print(f"interrupted: replay it again with --overwrite --out {out}", file=sys.stderr)
        raise typer.Exit(130) from None
    print(f"replayed {src} -> {out}: {verdict}", file=sys.stderr)
    if not same:
        raise typer.Exit(1)


def _simulate(cfg: ExperimentConfig, out: Path, mode: str, info: dict[str, Any],
              quiet: bool, workers: tuple[int, int] = (0, 0), raises: bool = False) -> None:
    """One simulated run with its progress bar (`workers`: --workers and --workers-per-gpu); a
    one-line error (exit 2; `raises`: the FedseqError itself, a campaign's failed run) or the
    resume line (exit 130) where it stops early."""
    from fedseq.common.algorithms import algorithm_class
    from fedseq.server.ops.simulation import run_simulation

    progress = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
        TextColumn("{task.fields[status]}"), console=err, disable=quiet,
    )
    with progress:
        task = progress.add_task(f"{cfg.algorithm.name} seed {cfg.seed}", total=cfg.rounds,
                                 status="loading data")
        last: dict[str, str] = {}  # the last evaluated accuracies, shown until the next ones
        tuning: list[Any] = []

        def on_round(row: RoundRecord) -> None:
            if row.global_acc is not None or row.personal_acc is not None:
                last["acc"] = (f"global{'*' if row.global_model else ''} {_fmt(row.global_acc)} "
                               f"personal {_fmt(row.personal_acc)} (round {row.round})")
            status = f"{row.phase} {last.get('acc', '')} {row.seconds or 0:.1f}s a round"
            progress.update(task, advance=1 if row.phase == "train" else 0, status=status)
            if row.global_model and not noted:
                noted.append(True)
                progress.console.print(f"note: global* = {row.global_model}")
            if row.round == cfg.rounds - 1 and algorithm_class(cfg.algorithm.name).finetunes(cfg):
                progress.update(task, status=status + " | fine-tuning")

        def on_progress(done: int, total: int) -> None:
            if not tuning:  # the final fine-tuning: a bar of its own, with its time left
                tuning.append(progress.add_task("fine-tuning", total=total, status="clients"))
            progress.update(tuning[0], completed=done)

        noted: list[bool] = []
        try:
            run_simulation(cfg, out, on_round, mode, info, on_progress, workers=workers[0],
                           workers_per_gpu=workers[1])
        except FedseqError as exc:
            progress.stop()
            if raises:
                raise
            _fail(exc)
        except KeyboardInterrupt:
            progress.stop()
            _interrupted(out, sweep="sweep" in info, again=(
                "run the same campaign command again" if "campaign" in info else None))


def _summary(out: Path) -> None:
    """The run in a few lines, from its run directory (a resumed run's earlier rounds included)."""
    from fedseq.server.report import load_run, summarize

    run = load_run(out)
    s = summarize(run)
    rows = run.train_rows

    def acc(name: str) -> str:
        a = s.accuracy[name]
        return "-" if a.final is None else f"final {a.final:.2f}%, best {a.best:.2f}%"

    failed = sum(len(r.failed) for r in rows)
    rejected = sum(len(r.rejected) for r in rows)
    ft = " + fine-tuning" if s.finetuned else ""
    star = " (not a trained whole model: see the global_model note)" if s.init_global else ""
    eps = next((s.metrics.pop(k) for k in list(s.metrics) if k.split()[0] == "epsilon"), None)
    privacy = run.config.get("privacy", {})
    z, c = privacy.get("noise_multiplier", 1.0), privacy.get("clip_norm", 1.0)
    how = (f"record-level DP-SGD, the most exposed client's; z = {z:g} a step, C = {c:g} an "
           "example" if privacy.get("level") == "record" else
           f"client-level DP-FedAvg; q = {run.config.get('train', {}).get('join_ratio', 0.2):g}, "
           f"z = {z:g}, C = {c:g}")
    dp = (f"  privacy: epsilon {eps:.3g} at delta {privacy.get('delta', 1e-5):g} ({how})\n"
          if eps is not None else "")
    print(f"run finished: {s.algorithm} on {s.dataset} ({s.model}), {s.rounds} rounds"
          f"{ft}, {s.wall_s:.0f} s\n"
          f"  global{star}: {acc('G')}\n"
          f"  personalized: {acc('P')}\n"
          f"  local model (FedReG testbed): {acc('L')}\n"
          f"  moved {s.mb_moved:.1f} MB, trained {s.train_tflop:.2f} TFLOP; "
          f"missing updates: {failed}, rejected: {rejected}\n"
          + dp
          + (f"  {more}\n" if (more := ", ".join(f"{k} {v:g}" for k, v in s.metrics.items()
                                                  if v is not None)) else "")
          + f"  -> {out}   (figures and tables: fedseq report {out})", file=sys.stderr)


def sim_main() -> None:
    """fedseq-sim's command line (its entry point is launch.py's `sim_main`)."""
    app = typer.Typer(add_completion=False)  # typer.run's, with the documentation's epilog
    app.command(epilog=EPILOG)(sim)
    app()


server_app = typer.Typer(add_completion=False, help="fedseq coordinator.", epilog=EPILOG)


ClientThreadsOpt = Annotated[
    int | None, typer.Option(help="torch threads per local client (default: cores / N)")]
LinkOpt = Annotated[list[str] | None, typer.Option(
    help="rehearse a testbed (root): put each local client in a network namespace behind "
         "an emulated link: wifi-good, wifi-poor, lte, 3g-fast or "
         "custom:down=MBIT,up=MBIT,delay=MS,jitter=MS,loss=PCT; DEVICE=PROFILE for one "
         f"device (repeatable; {page('rehearsal.md')})")]
CpuQuotaOpt = Annotated[list[str] | None, typer.Option(
    help="rehearsal (root): CPU cores per local client, e.g. 0.5; DEVICE=CORES for one")]
MetricsPortOpt = Annotated[int | None, typer.Option(
    help=f"serve Prometheus metrics on this port (0: a free one; {page('how-to/campaigns.md')})",
    min=0, max=65535)]
CampaignFileArg = Annotated[Path, typer.Argument(
    help="the campaign file (TOML): a base config and a grid of algorithms, seeds and settings")]
CampaignOutOpt = Annotated[Path, typer.Option(
    "--out", "-o", help="the campaign's folder: OUT/<setting>/<algorithm>/seed-<s> and campaign.json")]
CampaignDevicesOpt = Annotated[int, typer.Option(
    help="also start N devices here (fedseq-client daemons local01, local02, ...), up for the "
         "whole campaign")]
LocalDevicesOpt = Annotated[int, typer.Option(
    help="also start N devices here: fedseq-client daemons local01, local02, ... (each holds its "
         "share of the logical clients)")]
#: --local-devices' old name (it started devices, not clients): kept for one release, hidden
LocalClientsOpt = Annotated[int | None, typer.Option(
    "--local-clients", hidden=True, help="deprecated: the old name of --local-devices")]


MetricsHostOpt = Annotated[str, typer.Option(
    help="the metrics' address: loopback unless a Prometheus elsewhere must scrape it")]


def _local_devices(devices: int, old: int | None) -> int:
    """--local-devices N, or the deprecated --local-clients N (said in one line on stderr)."""
    if old is None:
        return devices
    if devices and devices != old:
        _fail(ConfigError(f"--local-clients {old} and --local-devices {devices}: give "
                          "--local-devices alone (--local-clients is its deprecated old name)"))
    print(f"--local-clients is deprecated: it starts devices, not clients; use --local-devices "
          f"{old} (the old name goes in the next release)", file=sys.stderr)
    return old


@server_app.command()
def start(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    out: OutOpt = None,
    broker: Annotated[str | None, typer.Option(help="mqtt://HOST:PORT of an external broker; "
                                                   "default: deploy.broker, else an embedded one")] = None,
    local_devices: LocalDevicesOpt = 0,
    local_clients: LocalClientsOpt = None,
    client_threads: ClientThreadsOpt = None,
    link: LinkOpt = None,
    cpu_quota: CpuQuotaOpt = None,
    username: UsernameOpt = None,
    password_file: PasswordFileOpt = None,
    ca_file: CaFileOpt = None,
    cert_file: CertFileOpt = None,
    key_file: KeyFileOpt = None,
    no_verify_hostname: NoVerifyOpt = False,
    resume: ResumeOpt = None,
    overwrite: OverwriteOpt = False,
    metrics_port: MetricsPortOpt = None,
    metrics_host: MetricsHostOpt = "127.0.0.1",
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
) -> None:
    """Run an experiment on a device fleet over MQTT and write a run directory."""
    from fedseq.server.ops.deployment import run_deployment

    local_devices = _local_devices(local_devices, local_clients)
    cfg, out, mode, info = _start(config, set_, out, resume, overwrite)
    _refuse_used_out(out, mode)
    _login_flags(cfg, no_verify_hostname, username=username, password_file=password_file,
                 ca_file=ca_file, cert_file=cert_file, key_file=key_file)
    try:
        with _rehearsal(local_devices, link or [], cpu_quota or [], cfg) as rehearsal, \
                _metrics(metrics_port, metrics_host) as metrics:
            if metrics is not None:
                metrics.run_started(cfg, str(out))
            shown = _Printer(cfg.rounds)
            run_deployment(cfg, out, broker, local_devices,
                           on_round=_rows(None if quiet else shown.row, metrics),
                           announce=lambda s: print(s, file=sys.stderr),
                           client_threads=client_threads, mode=mode, info=info,
                           on_progress=None if quiet else shown.progress, rehearsal=rehearsal)
    except FedseqError as exc:
        _fail(exc)
    except KeyboardInterrupt:
        _interrupted(out)
    _summary(out)


@server_app.command()
def campaign(
    file: CampaignFileArg,
    out: CampaignOutOpt,
    set_: SetOpt = None,
    broker: Annotated[str | None, typer.Option(help="mqtt://HOST:PORT of the fleet's broker; "
                                                   "default: deploy.broker, else an embedded one")] = None,
    local_devices: CampaignDevicesOpt = 0,
    local_clients: LocalClientsOpt = None,
    client_threads: ClientThreadsOpt = None,
    link: LinkOpt = None,
    cpu_quota: CpuQuotaOpt = None,
    username: UsernameOpt = None,
    password_file: PasswordFileOpt = None,
    ca_file: CaFileOpt = None,
    cert_file: CertFileOpt = None,
    key_file: KeyFileOpt = None,
    no_verify_hostname: NoVerifyOpt = False,
    metrics_port: MetricsPortOpt = None,
    metrics_host: MetricsHostOpt = "127.0.0.1",
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No round lines.")] = False,
) -> None:
    """Run every run of a campaign file on the fleet, one after another, unattended: the broker
    and the devices stay up between runs. The same command again continues the campaign
    (docs: "Run a campaign", how-to/campaigns/)."""
    from fedseq.server.ops.campaign import Progress as CampaignProgress
    from fedseq.server.ops.deployment import standing_fleet

    local_devices = _local_devices(local_devices, local_clients)

    spec, runs, book = _open_campaign(file, set_ or [], out)
    for run in runs:
        _login_flags(run.cfg, no_verify_hostname, username=username, password_file=password_file,
                     ca_file=ca_file, cert_file=cert_file, key_file=key_file)

    say = lambda s: print(s, file=sys.stderr)  # noqa: E731
    try:
        with _rehearsal(local_devices, link or [], cpu_quota or [], runs[0].cfg) as rehearsal, \
                standing_fleet(runs[0].cfg, out, broker, local_devices, client_threads, say,
                               rehearsal) as (url, login, _), \
                _metrics(metrics_port, metrics_host) as metrics, \
                _campaign_beacon(runs[0].cfg, url, login, metrics) as beacon:
            def publish(status: Any) -> None:
                beacon(status)
                if metrics is not None:
                    metrics.campaign(status)

            progress = CampaignProgress(book, publish)
            one = _campaign_run(url, login, local_devices, progress, metrics, client_threads,
                                say, quiet)
            _go_campaign(spec, book, one, progress)
    except FedseqError as exc:
        _fail(exc)
    except KeyboardInterrupt:
        print(f"interrupted: {out} keeps every complete round; continue with the same "
              "fedseq-server campaign command", file=sys.stderr)
        raise typer.Exit(130) from None


def _campaign_run(url: str, login: dict[str, Any], local_devices: int, progress: Any,
                  metrics: Any, client_threads: int | None, say: Callable[[str], None],
                  quiet: bool) -> Any:
    """How a campaign on a standing fleet runs one of its runs: on the broker at `url`, with the
    fleet's `login` and at least its `local_devices`."""
    from fedseq.server.ops.deployment import run_deployment

    def one(run: Any, path: Path, mode: str, info: dict[str, Any]) -> None:
        settings = run.cfg.deploy.model_copy(update={
            **login, "min_devices": max(run.cfg.deploy.min_devices, local_devices)})
        if metrics is not None:
            metrics.run_started(run.cfg, str(path))

        def row(r: RoundRecord) -> None:
            progress.round_done(r.round, r.phase, r.seconds)

        shown = _Printer(run.cfg.rounds)
        run_deployment(run.cfg.model_copy(update={"deploy": settings}), path, url, 0,
                       on_round=_rows(row, None if quiet else shown.row, metrics),
                       announce=say, client_threads=client_threads, mode=mode, info=info,
                       on_progress=None if quiet else shown.progress)
    return one


def _rows(*sinks: Any) -> Any:
    """One on_round callback that hands each row to every sink given (a Metrics' row method for
    a Metrics)."""
    calls = [getattr(s, "row", s) for s in sinks if s is not None]
    return (lambda r: [c(r) for c in calls]) if calls else None


@contextlib.contextmanager
def _metrics(port: int | None, host: str) -> Iterator[Any]:
    """--metrics-port: the Prometheus endpoint for the command's lifetime (None without it)."""
    if port is None:
        yield None
        return
    from fedseq.server.ops.metrics import Metrics

    try:
        metrics = Metrics(port, host)
    except OSError as exc:
        _fail(ConfigError(f"--metrics-port {port}: cannot listen on {host}:{port} ({exc}); "
                          "pick a free port"))
    print(f"Prometheus metrics at http://{host}:{metrics.port}/metrics", file=sys.stderr)
    try:
        yield metrics
    finally:
        metrics.close()


@contextlib.contextmanager
def _campaign_beacon(cfg: ExperimentConfig, url: str, login: dict[str, Any],
                     metrics: Any = None) -> Iterator[Any]:
    """Publishes a campaign's progress retained on the broker for `fedseq-server status` (with the
    coordinator's login), and with `metrics` counts the devices online from their statuses; a
    broker that refuses it costs the campaign nothing but that line."""
    from fedseq.common.errors import ProtocolError
    from fedseq.common.protocol.link import Link, session_id
    from fedseq.common.protocol.messages import DeviceStatus
    from fedseq.common.protocol.topics import DEVICE_NAME, Topics
    from fedseq.server.ops.broker import coordinator_login
    from fedseq.server.pools.mqtt.budget import LoginBudgets, allowance, thread_seconds
    from fedseq.server.pools.mqtt.inbox import MAX_STRANGERS, STATUS_BYTES

    d = cfg.deploy.model_copy(update=login)
    t = Topics(d.topic_root)
    topic = t.campaign

    budgets = LoginBudgets()
    statuses_only = allowance(0, 0)

    def on_message(name: str, payload: bytes) -> None:
        """Read under the run's own caps (inbox.py): a status over STATUS_BYTES is dropped
        unread, each device name spends its login's bytes and CPU budget (a flood of statuses
        costs the campaign what it costs the run, no more), and the names counted are bounded."""
        ref = t.parse(name)
        device = ref.device if ref is not None and ref.kind == "device_status" else ""
        if (len(payload) > STATUS_BYTES or not DEVICE_NAME.fullmatch(device)
                or not budgets.admit(device, len(payload), statuses_only)):
            return
        began = thread_seconds()
        try:
            status = DeviceStatus.decode(payload) if payload else None
        except ProtocolError:
            status = None  # the coordinator's inbox says why; these counts are only a gauge
        finally:
            budgets.spent(device, thread_seconds() - began)
        if status is not None and status.device == device:
            metrics.device_status(status)
        if len(budgets.logins()) > 2 * MAX_STRANGERS:
            for old in budgets.logins()[:MAX_STRANGERS]:
                budgets.forget(old)

    username, password, tls = coordinator_login(d)
    link = Link(session_id("fedseq-campaign"), url, [t.device_status()] if metrics else [],
                on_message, username=username, password=password, tls=tls)
    try:
        link.start(attempts=3)
    except FedseqError as exc:
        print(f"warning: the campaign's progress is not published for fedseq-server status: {exc}",
              file=sys.stderr)
        yield lambda status: None
        return
    try:
        yield lambda status: link.publish(topic, status.model_dump_json().encode(), retain=True)
    finally:
        link.stop()


def _rehearsal(local_devices: int, links: list[str], quotas: list[str],
               cfg: ExperimentConfig) -> Any:
    """The rehearsal --link / --cpu-quota ask for (a context manager), or a null context. With
    [hierarchy], a tree: the local devices are the sites' first N, each site behind its uplink
    (hierarchy.links)."""
    import contextlib

    from fedseq.server.ops import rehearsal as rh
    from fedseq.server.ops.local_fleet import local_device_names
    from fedseq.server.rounds import links as ln
    from fedseq.server.rounds.sites import site_tree

    if not links and not quotas:
        return contextlib.nullcontext()
    if not local_devices:
        raise ConfigError("--link and --cpu-quota shape the local devices: add --local-devices N")
    # the sites' tree as the run deals it (sites.py site_tree): the devices SitesTransport starts
    tree = site_tree(cfg) if cfg.hierarchy else []
    names = ([d for s in tree for d in s.devices][:local_devices] if tree
             else local_device_names(local_devices))
    if len(names) < local_devices:
        raise ConfigError(f"--local-devices {local_devices}: hierarchy.sites names {len(names)} "
                          "devices")
    sites = {s.name: [d for d in s.devices if d in names] for s in tree}
    sites = {s: ds for s, ds in sites.items() if ds}
    return rh.Rehearsal(names, rh.per_device(links, names, ln.parse_profile, "--link"),
                        rh.per_device(quotas, names, rh.parse_quota, "--cpu-quota"), sites,
                        {s.name: s.link for s in tree if s.name in sites and s.link is not None})


def _left(seconds: float) -> str:
    """A time left as the progress lines say it: "~40 s", "~12 min", "~2.5 h"."""
    if seconds < 90:
        return f"~{seconds:.0f} s"
    if seconds < 5400:
        return f"~{seconds / 60:.0f} min"
    return f"~{seconds / 3600:.1f} h"


class _Printer:
    """A fleet run's progress on stderr: a line per round with the time left at the pace of
    the rounds this process saw (evaluations included), and the fine-tuning's clients about
    every tenth with theirs."""

    def __init__(self, rounds: int):
        self.rounds = rounds
        self.started: float | None = None  # when the first row of this process came
        self.seen = 0
        self.note = False
        #: the fine-tuning's (first report's time, its clients done, the tenth last shown)
        self.tuning: tuple[float, int, int] | None = None

    def row(self, row: RoundRecord) -> None:
        """One round's (or the fine-tuning's) line."""
        now = time.monotonic()
        if row.global_model and not self.note:
            self.note = True
            print(f"note: global* = {row.global_model}", file=sys.stderr)
        star = "*" if row.global_model else ""
        reported = row.reported if row.phase == "train" else row.clients
        left = ""
        if row.phase == "train":
            if self.started is None:  # the pace counts from the end of the first round seen
                self.started = now - (row.seconds or 0.0)
            self.seen += 1
            remaining = self.rounds - 1 - row.round
            if remaining > 0:
                left = f", {_left((now - self.started) / self.seen * remaining)} left"
        print(f"round {row.round + 1}/{self.rounds} {row.phase}: global{star} "
              f"{_fmt(row.global_acc)} personal {_fmt(row.personal_acc)} reported "
              f"{len(reported)}/{len(row.clients)} {row.seconds or 0:.1f}s{left}", file=sys.stderr)

    def progress(self, done: int, total: int) -> None:
        """The fine-tuning's clients, about every tenth of them, with the time left."""
        now = time.monotonic()
        if self.tuning is None:  # the pace counts from the first client reported
            self.tuning = (now, done, -1)
        began, first, shown = self.tuning
        step = max(1, total // 10)
        if done == total or done // step != shown:
            self.tuning = (began, first, done // step)
            left = (f", {_left((now - began) / (done - first) * (total - done))} left"
                    if first < done < total else "")
            print(f"fine-tuning: {done}/{total} clients{left}", file=sys.stderr)


@server_app.command()
def edge(
    site: Annotated[str, typer.Option(help="this site's name, as hierarchy.sites names it")],
    broker: Annotated[str, typer.Option(help="mqtt://HOST:PORT of the site's broker (its "
                                             "devices' broker)")],
    upstream: Annotated[str, typer.Option(help="mqtt://HOST:PORT of the coordinator's broker")],
    data_dir: Annotated[Path | None, typer.Option(
        help="the data root on this host (the partition's sizes; default: the one data root "
             "of every command)")] = None,
    topic_root: Annotated[str, typer.Option(help="deploy.topic_root of the runs")] = "fedseq",
    username: UsernameOpt = None,
    password_file: PasswordFileOpt = None,
    ca_file: CaFileOpt = None,
    cert_file: CertFileOpt = None,
    key_file: KeyFileOpt = None,
    no_verify_hostname: NoVerifyOpt = False,
    upstream_username: Annotated[str | None, typer.Option(
        help="the coordinator's broker: this edge's login")] = None,
    upstream_password_file: Annotated[Path | None, typer.Option(
        help="the coordinator's broker: the file of this edge's password")] = None,
    upstream_ca_file: Annotated[Path | None, typer.Option(
        help="the coordinator's broker, mqtts://: its CA's PEM file")] = None,
    upstream_cert_file: Annotated[Path | None, typer.Option(
        help="the coordinator's broker, mutual TLS: this edge's certificate")] = None,
    upstream_key_file: Annotated[Path | None, typer.Option(
        help="the coordinator's broker, mutual TLS: the certificate's key")] = None,
    guard_username: Annotated[str | None, typer.Option(
        help="the site's broker: the flood guard's login (fedseq-guard; docs/security.md)")] = None,
    guard_password_file: Annotated[Path | None, typer.Option(
        help="the site's broker: the file of the flood guard's password")] = None,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING or ERROR")] = "INFO",
) -> None:
    """Run a site's edge aggregator (the config's hierarchy section): to the coordinator one
    participant holding the site's clients, to the site's devices their coordinator; it folds
    their updates and sends one partial aggregate a round (docs/how-to/edge-sites.md). Runs
    until stopped."""
    from fedseq.common.files import read_secret
    from fedseq.common.protocol.link import TlsOptions
    from fedseq.server.ops.edge import Login, serve_until_stopped
    from fedseq.server.pools.mqtt.edges import site_name_problem

    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if (why := site_name_problem(site)) is not None:
            raise ConfigError(why)
        verify = not no_verify_hostname
        serve_until_stopped(
            site, upstream, broker, data_dir, topic_root,
            Login(upstream_username, read_secret(upstream_password_file,
                                                 "--upstream-password-file"),
                  TlsOptions(upstream_ca_file, upstream_cert_file, upstream_key_file, verify)),
            Login(username, read_secret(password_file, "--password-file"),
                  TlsOptions(ca_file, cert_file, key_file, verify), guard_username,
                  guard_password_file))
    except FedseqError as exc:
        _fail(exc)


@server_app.command()
def passwd(
    file: Annotated[Path, typer.Argument(help="amqtt password file to create or update")],
    user: Annotated[str, typer.Argument(help="account name (a device's name, or the coordinator's)")],
    password_file: Annotated[Path | None, typer.Option(
        help="read the password from this file instead of asking")] = None,
) -> None:
    """Add or replace an account in the embedded broker's password file (argon2 hashes)."""
    from fedseq.common.files import atomic_write
    from fedseq.server.ops.broker import hash_password

    if ":" in user or not user.strip():
        _fail(ValueError(f"user name {user!r} must be non-empty and contain no ':'"))
    try:
        password = (password_file.read_text().strip() if password_file
                    else typer.prompt("password", hide_input=True, confirmation_prompt=True))
        lines = file.read_text().splitlines() if file.exists() else []
        lines = [ln for ln in lines if ln.split(":", 1)[0] != user] + [f"{user}:{hash_password(password)}"]
        atomic_write(file, ("\n".join(lines) + "\n").encode(), mode=0o600)  # never readable by others
    except OSError as exc:
        _fail(ValueError(f"{exc.filename}: {exc.strerror}"))
    print(f"{user} written to {file}", file=sys.stderr)


@server_app.command()
def status(
    broker: Annotated[str | None, typer.Option(
        help="mqtt://HOST:PORT or mqtts://HOST:PORT (default: deploy.broker of --config)")] = None,
    config: Annotated[Path | None, typer.Option(
        "--config", "-c", help="Experiment TOML file (its deploy.broker, else its embedded "
                               "broker's host and port), or a run directory of fedseq-server "
                               "start (the broker it ran on).")] = None,
    username: UsernameOpt = None,
    password_file: PasswordFileOpt = None,
    ca_file: CaFileOpt = None,
    cert_file: CertFileOpt = None,
    key_file: KeyFileOpt = None,
    no_verify_hostname: NoVerifyOpt = False,
    wait: Annotated[float, typer.Option(help="seconds to collect the broker's retained state")] = 2.0,
    all_: Annotated[bool, typer.Option(
        "--all", help="a line per device however large the fleet (beyond 30 devices the default "
                      "is a summary: counts, then the devices that need a look)")] = False,
) -> None:
    """Show the fleet as the broker knows it: coordinator, run, current step and every device
    (online or offline, since when, versions, torch device, memory, last error); a large fleet
    as counts by state and problem, the devices with a problem first."""
    from fedseq.server.ops.broker import coordinator_login
    from fedseq.server.ops.status import format_fleet, read_fleet

    ran_on = None
    if config is not None and config.is_dir():  # a run directory: its config and its broker
        try:
            cfg = load_run_config(config)
            ran_on = json.loads((config / "status.json").read_text()).get("broker")
        except (FedseqError, OSError, ValueError, AttributeError) as exc:
            _fail(ConfigError(f"--config {config}: not a run directory fedseq-server start "
                              f"wrote ({exc})"))
    else:
        cfg, _, _, _ = _start(config, None, Path("unused"))
    _login_flags(cfg, no_verify_hostname, username=username, password_file=password_file,
                 ca_file=ca_file, cert_file=cert_file, key_file=key_file)
    d = cfg.deploy
    # the broker named, the config's, the one the run directory ran on, or the config's embedded
    embedded = f"mqtt://{d.host}:{d.port}" if config is not None and d.port else None
    url = broker or d.broker or (ran_on if isinstance(ran_on, str) else None) or embedded
    if url is None:
        _fail(ValueError("no broker: pass --broker mqtt://HOST:PORT, a --config with deploy.broker "
                         "or a run directory as --config"))
    try:
        view = read_fleet(url, d.topic_root, *coordinator_login(d), wait)
    except FedseqError as exc:
        _fail(exc)
    for line in format_fleet(view, url, every=all_):
        print(line)


def _version_flag(value: bool) -> None:
    if value:
        from fedseq.common import __version__

        print(__version__)
        raise typer.Exit()


VersionOpt = Annotated[bool, typer.Option("--version", callback=_version_flag, is_eager=True,
                                          help="Print the package version and exit.")]


@server_app.callback()
def _server_options(version: VersionOpt = False) -> None:
    """fedseq coordinator: start a run on a device fleet, see the fleet, manage embedded-broker
    accounts."""


@server_app.command()
def version() -> None:
    """Print the package version."""
    from fedseq.common import __version__

    print(__version__)


def server_main() -> None:
    """fedseq-server's command line: start, campaign, status, passwd (its entry point is launch.py's
    `server_main`)."""
    server_app()


if __name__ == "__main__":  # pragma: no cover
    sim_main()
