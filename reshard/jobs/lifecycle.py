"""The one lifecycle every job that writes an output runs: decide, lock, stage, journal, publish, clean up.

    from reshard.jobs.lifecycle import RESHARD, JobOutput, Lifecycle
    life = Lifecycle(dst, tag, leader=transport.rank == 0, words=RESHARD)
    start = life.begin(transport, lambda: JobOutput(fingerprint, ours={...}))  # worker 0 decides; all learn
    if start.mode != "complete":
        life.run(lambda: work(life))     # the job kind's work calls life.opened(), life.journal(n),
                                         # and last life.publish(transport, hashes, place)

Every kind of job runs this sequence, and only this one: the collective job (reshard.jobs.collective_job, also
node-local, where each node's leader runs the destination steps for its own DST), the
exports
(reshard.export.runner), and each SLURM array task (reshard.jobs.array_job), which has no peers
and shares its staging with the other tasks: it resumes per file (`ResumeByFile`) where the others
resume by rounds (`ResumeByRounds`), and its set is placed by `publish_sets` once every task is done.

Call order, and which workers run each step:

1. `begin` (the leader decides, every worker learns the `Start`): DST already holds this very
   output (its manifest's fingerprint and every hash match) -> "complete", nothing to do;
   else refuse a DST holding files not ours (unless --overwrite), see what an interrupted run left
   (the `resume` given: `ResumeByRounds`, the default, or `ResumeByFile`), check free space, take
   the lock (reshard.jobs.lock: DST's, or an array task's own), and either resume the staging of an
   interrupted run with the same plan (its journal, reshard.jobs.manifest) or create a fresh
   DST/.reshard-staging/TAG (reshard.jobs.destination.Staging) and journal it; an array task
   instead writes the files of its share not yet marked done;
2. the job kind's work, on every worker: `opened()` once the files exist (the journal says so),
   `journal(rounds_done)` after each durable stretch;
3. `publish(transport, hashes, place)`: every worker's hashes are gathered; the leader runs
   `place(all_hashes)` (manifest, journal removed, tag directory into place, `latest` last:
   `publish_checkpoint`; an export completes its staging, then places it with `publish_tag_dir` or
   `publish_files`); all agree. An array task has no peers to
   agree with: after its share, `publish_sets` places, under DST's lock, every set whose files are
   all done, then `latest`;
4. `run` wraps 2-3: on failure the leader keeps the staging for a resume once rounds began (an
   array task's always: its finished files stay marked done), else
   removes it (and DST, when this run created it), releases the lock, and the message ends with
   what stays on disk (reshard.jobs.destination.what_was_kept); on success the leader releases the lock.

What a job kind supplies, and the lifecycle never branches on: the `JobOutput` (its fingerprints,
the names in DST that are its own, an earlier output to compare with, the bytes it needs), the work
(rounds through reshard.jobs.execute, or whole files built by each worker), `place` (what
publishing means for its output), and for array tasks the `ResumeByFile` (the files the task owns,
their completion markers) and each `ReadySet`'s assembly.
"""
from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from reshard.jobs import save_dir_files
from reshard.transport.collective import check_peers, on_rank0
from reshard.jobs.destination import (
    DEEPSPEED_NAMES,
    RESHARD_NAMES,
    STAGING,
    Staging,
    check_empty,
    clean_up_after_failure,
    what_was_kept,
    write_latest,
)
from reshard.errors import OptionError, PeerFailure, ReshardError
from reshard.formats.deepspeed_files.deepspeed_schema import LATEST
from reshard.jobs.lock import DestinationLock
from reshard.jobs.manifest import JOURNAL_NAME, Manifest, read_journal, write_journal
from reshard.files.paths import confined
from reshard.files.resources import check_free_space, disk_full_message, is_disk_full
from reshard.formats.deepspeed_files.target_writer import WriteFailed
from reshard.version import __version__


@dataclass(frozen=True)
class Words:
    """How a kind of job names itself in the notes and messages the lifecycle writes."""

    run: str
    """"run" or "export": "resuming an interrupted run", "the staging of an earlier export"."""
    changed: str
    """What a different plan fingerprint means, for the note on a discarded staging."""
    publishing: str
    """The step named when publishing fails on some worker."""


RESHARD = Words("run", "(source, target size, worker count or budget changed)", "publishing the result")
EXPORT = Words("export", "(source, options, worker count or budget changed)", "publishing the output")


@dataclass
class JobOutput:
    """What a job kind says about its output, worked out by the leader when the lifecycle begins."""

    output_fingerprint: str
    """Identifies the output (reshard.jobs.manifest.output_fingerprint / export_fingerprint)."""
    ours: set[str]
    """Names directly in DST that belong to this output (and reshard): anything else needs --overwrite.
    The lifecycle is the one place that checks it (`decide_start`); reshard's own staging and lock
    (reshard.jobs.destination.RESHARD_NAMES) are always among them."""
    plan_fingerprint: str | None = None
    """Identifies the rounds (reshard.jobs.manifest.plan_fingerprint); None: nothing to resume (whole files)."""
    rounds: int = 0
    identity: dict = field(default_factory=dict)
    """The source files' sizes and mtimes (reshard.jobs.manifest.source_identity): the manifest's source files."""
    needed_bytes: int | None = None
    """About how many bytes the output takes: checked against DST's free space; None: not checked."""
    earlier: Manifest | None = None
    """The manifest of an earlier output in DST/TAG to compare with ("complete" when it is this one)."""
    latest: str | None = None
    """The tag `latest` names once the output is in place (also written when it was already complete)."""


@dataclass
class Start:
    """Where this run starts, decided by the leader from what the destination holds."""

    mode: str
    """"fresh", "resume" (staging of an interrupted run with the same plan) or "complete"."""
    output_fingerprint: str
    plan_fingerprint: str
    identity: dict
    rounds_done: int = 0
    skeletons: bool = False
    """The staged files exist already (a resume reopens them)."""
    notes: list = field(default_factory=list)
    output_bytes: int = 0
    created_destination: bool = False
    """DST did not exist before this run: a failure before the rounds removes it again."""
    remaining: list = field(default_factory=list)
    """Resumed per file (ResumeByFile): the files of this task's share still to write."""


def destination_names(earlier_outputs, carried: list[str]) -> set[str]:
    """The names in DST a reshard of a DeepSpeed save may find there without --overwrite: staging and
    lock always; with an earlier output of this source there, its tags, `latest`, the recovery
    scripts and the save directory's carried files (reshard.jobs.save_dir_files)."""
    ours = set(RESHARD_NAMES)
    if earlier_outputs:
        ours |= set(earlier_outputs) | DEEPSPEED_NAMES | save_dir_files.top_level_names(carried)
    return ours


def earlier_output_is_complete(earlier: Manifest | None, fingerprint: str, final_tag_dir: str) -> bool:
    """DST/TAG already holds this very output: the same fingerprint, and every file's hash matches."""
    return earlier is not None and earlier.fingerprint == fingerprint and not earlier.check_files(final_tag_dir)


def already_complete_note(final_tag_dir: str) -> str:
    return f"{final_tag_dir} already holds this output (every hash matches); nothing to do"


class ResumeByRounds:
    """How a job with peers resumes (the collective and node-local jobs, the whole-file jobs, the
    exports): one staging per run, DST/.reshard-staging/TAG, whose journal (reshard.jobs.manifest)
    names the plan its files follow and how many rounds are durable. A run with the same plan
    fingerprint continues from there; a staging of another plan is discarded and made afresh. No
    plan fingerprint (whole files): never a resume. The lock is DST's; a failure keeps the staging
    only once the rounds began."""

    lock_dir = None
    """The lock is DST's own (reshard.jobs.lock)."""

    def survey(self, staging: Staging, output: JobOutput):
        """Before the lock: (what this run continues, bytes the output needs, bytes already on disk)."""
        journal = read_journal(staging.tag_dir)
        plan_fp = output.plan_fingerprint or output.output_fingerprint
        resume = bool(output.plan_fingerprint is not None and journal and journal.get("plan_fingerprint") == plan_fp
                      and journal.get("skeletons"))
        return (journal, resume), output.needed_bytes, allocated_bytes(staging.tag_dir) if resume else 0

    def settle(self, staging: Staging, output: JobOutput, start: Start, found, words: Words,
               lock: DestinationLock) -> None:
        """Holding the lock: resume the staging found, or make a fresh one and journal it."""
        journal, resume = found
        if resume:
            start.mode, start.skeletons = "resume", True
            start.rounds_done = int(journal.get("rounds_done", 0))
            start.notes.append(f"resuming an interrupted {words.run}: {start.rounds_done} of {output.rounds} rounds "
                               "were done")
            return
        if journal and output.plan_fingerprint is not None:
            start.notes.append(f"discarded the staging of an earlier {words.run} with a different plan {words.changed}")
        try:
            staging.create()
            write_journal(staging.tag_dir, start.plan_fingerprint, False, 0)
        except BaseException:
            clean_up_after_failure(staging, lock, keep_staging=False, remove_destination=start.created_destination)
            raise

    def keeps_staging(self, rounds_started: bool) -> bool:
        return rounds_started

    def what_was_kept(self, staging: Staging, kept: bool, removed_destination: bool, error: ReshardError) -> str:
        return what_was_kept(staging, kept, removed_destination)

    def released(self, lock: DestinationLock) -> None:
        pass


BY_ROUNDS = ResumeByRounds()


@dataclass
class ResumeByFile:
    """How one of several independent tasks resumes its share of one output (a SLURM array task,
    reshard.jobs.array_job): the tasks write into one staging, DST/.reshard-staging/TAG, that none
    of them owns, so there is no journal and no round; a file is done once its completion marker
    exists (`is_done`: the task writes it after the file is fsynced), and a run writes the files of
    its share that are not done. The lock is the task's own (`lock_dir`, removed with it), so tasks
    run at once; a failure keeps the staging and every marker. The set is published once every
    task's files are done (`publish_sets`)."""

    share: dict
    """name -> bytes of each file this task writes: what its free-space check weighs."""
    is_done: Callable[[str], bool]
    directories: tuple[str, ...]
    """The directories of the markers, made beside the staging (inside DST, never through a link)."""
    prepare: Callable[[Staging], None]
    """Runs once the staging and `directories` exist: records what the set is, or refuses it."""
    lock_dir: str
    rerun: str
    """Where the finished files stay marked done and how to write the rest: the end of a failure's message."""

    def survey(self, staging: Staging, output: JobOutput):
        for directory in (staging.root, staging.tag_dir, *self.directories):
            if os.path.islink(directory):
                raise OptionError(f"{directory}: is a symbolic link; reshard does not write through links inside "
                                  "the destination (remove it)")
            os.makedirs(confined(staging.destination, directory), exist_ok=True)
        if os.path.exists(os.path.join(staging.tag_dir, JOURNAL_NAME)):  # a ResumeByRounds staging
            raise OptionError(f"{staging.tag_dir}: holds an interrupted collective job (it has a journal); re-run "
                              "that job to resume it, or remove the directory")
        self.prepare(staging)
        remaining = [name for name in self.share if not self.is_done(name)]
        return remaining, sum(self.share[name] for name in remaining), 0

    def settle(self, staging: Staging, output: JobOutput, start: Start, remaining, words: Words,
               lock: DestinationLock) -> None:
        start.remaining = remaining
        if len(remaining) < len(self.share):
            start.mode = "resume"
            start.notes.append(f"{len(self.share) - len(remaining)} of this task's {len(self.share)} file(s) were "
                               "already done")

    def keeps_staging(self, rounds_started: bool) -> bool:
        return True  # other tasks write there too, and every file marked done stays done

    def what_was_kept(self, staging: Staging, kept: bool, removed_destination: bool, error: ReshardError) -> str:
        return f". {self.rerun}" if isinstance(error, WriteFailed) else ""

    def released(self, lock: DestinationLock) -> None:
        shutil.rmtree(os.path.dirname(lock.path), ignore_errors=True)


def decide_start(destination: str, tag: str, output: JobOutput, lock: DestinationLock, overwrite: bool,
                 words: Words = RESHARD, allow_complete: bool = True, resume=BY_ROUNDS) -> Start:
    """Step 1 on the leader: complete, resume or fresh; the lock taken and the staging ready unless complete.
    `resume` (ResumeByRounds, ResumeByFile) says what an interrupted run left and how this one continues it."""
    plan_fp = output.plan_fingerprint or output.output_fingerprint
    start = Start("fresh", output.output_fingerprint, plan_fp, output.identity)
    final = os.path.join(destination, tag)
    if allow_complete and earlier_output_is_complete(output.earlier, output.output_fingerprint, final):
        if output.latest:
            write_latest(destination, output.latest)
        start.mode = "complete"
        start.notes.append(already_complete_note(final))
        return start
    check_empty(destination, output.ours | RESHARD_NAMES, overwrite)
    start.created_destination = not os.path.lexists(destination)
    staging = Staging(destination, tag)
    found, needed_bytes, already_written = resume.survey(staging, output)
    if needed_bytes is not None:
        start.output_bytes = needed_bytes
        check_free_space(destination, needed_bytes, already_written)
    lock.acquire()
    if lock.stale_note:
        start.notes.append(lock.stale_note)
    resume.settle(staging, output, start, found, words, lock)
    return start


def allocated_bytes(directory: str) -> int:
    """Disk space the files under `directory` already occupy (skeletons are sparse until written)."""
    total = 0
    for root, _, names in os.walk(directory):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def publish_tag_dir(staging: Staging, manifest: Manifest | None, latest: str | None, scripts_from: str | None,
                    carried: list[str] = (), latest_name: str = LATEST) -> None:
    """Publish a tag directory from staging, once the job has written everything into it: the
    manifest (None: an export, which has none), the journal removed (until then a failure leaves a
    staging the same command resumes), the save directory's carried files (before the tag
    directory and `latest`: a resume finds them once it finds the checkpoint), then the tag
    directory by one rename and the pointer file `latest_name` (`latest`, or a universal
    checkpoint's `latest_universal`) last, replaced atomically (reshard.jobs.destination)."""
    if manifest is not None:
        manifest.write(staging.tag_dir)
    _remove_journal(staging)
    if carried:
        save_dir_files.publish(save_dir_files.staging_dir(staging.tag_dir), carried, staging.destination)
    staging.publish(latest, scripts_from=scripts_from, latest_name=latest_name)


def publish_checkpoint(staging: Staging, fingerprint: str, source: dict, target: dict, files: dict,
                       latest: str | None, scripts_from: str | None, carried: list[str] = ()) -> None:
    """Publish a resharded checkpoint, the last step of every job kind that writes one (the collective and
    node-local jobs, reshard.jobs.collective_job; a SLURM array set, reshard.jobs.array_job): its manifest
    (reshard.jobs.manifest.Manifest: the output's `fingerprint`, the `source` and `target` entries, every
    file's size and hash, this reshard's version), then `publish_tag_dir`."""
    publish_tag_dir(staging, Manifest(fingerprint, source=source, target=target, files=files,
                                      reshard_version=__version__),
                    latest, scripts_from=scripts_from, carried=carried)


def publish_files(staging: Staging, last: str) -> None:
    """Publish an output that is a directory of files (the safetensors export), once the job has
    written everything into staging: every target checked, then the journal removed, then every
    file moved into DST by an atomic rename, `last` (the file that makes the directory complete) after all others
    (reshard.jobs.destination.Staging.publish_files)."""
    staging.publish_files(last=last, before_moves=lambda: _remove_journal(staging))


def _remove_journal(staging: Staging) -> None:
    """The staging is no longer an interrupted run (an array task's staging has no journal)."""
    journal = os.path.join(staging.tag_dir, JOURNAL_NAME)
    if os.path.lexists(journal):
        os.unlink(journal)


@dataclass(frozen=True)
class ReadySet:
    """An output written by independent tasks (ResumeByFile) whose every file is done: `publish_sets` places it."""

    tag: str
    fingerprint: str
    bookkeeping: str
    """The directory of its completion markers (inside DST's staging): removed once the set is in place."""
    place: Callable[[], None]
    """Assemble it and put it in place: its manifest from the markers, then `publish_tag_dir`."""
    output: str | None = None
    """What the notes name: DST/TAG (None), or DST itself for an output of files (an export's array set)."""


def publish_sets(destination: str, ready: list[ReadySet], *, tags: list[str], latest: str | None,
                 lock_wait: float = 60.0) -> list[str]:
    """Publish the sets in `ready` and write `latest` last, holding DST's lock, so that however many
    tasks finish at once exactly one places each set and writes `latest`.

    `tags`: every tag DST receives; `latest` (the tag it names) is written once all of them are
    in place. Waits up to `lock_wait` seconds for another publisher; then leaves it to that one.
    Returns notes for the summary."""
    notes = []
    if not ready and (latest is None or latest_is(destination, latest)):
        return notes
    lock = DestinationLock(destination)
    deadline = time.monotonic() + lock_wait
    while True:
        try:
            lock.acquire()
            break
        except OptionError as error:
            if time.monotonic() > deadline:
                return [f"not published by this task: {error}"]
            time.sleep(0.2)
    try:
        if lock.stale_note:
            notes.append(lock.stale_note)
        for output in ready:
            if os.path.isdir(output.bookkeeping) and not is_published(destination, output.tag, output.fingerprint):
                output.place()
                notes.append(f"published {output.output or os.path.join(destination, output.tag)} (this task "
                             "completed the set)")
            shutil.rmtree(confined(destination, output.bookkeeping), ignore_errors=True)
        root = os.path.join(destination, STAGING)
        if os.path.isdir(root) and not os.listdir(root):
            os.rmdir(root)
        if latest is not None and all(is_published(destination, tag) for tag in tags) \
                and not latest_is(destination, latest):
            write_latest(destination, latest)
            notes.append(f"wrote {os.path.join(destination, LATEST)} -> {latest}")
    finally:
        lock.release()
    return notes


def is_published(destination: str, tag: str, fingerprint: str | None = None) -> bool:
    """DST/TAG holds a manifest (of the output `fingerprint`, when given)."""
    try:
        manifest = Manifest.read(os.path.join(destination, tag))
    except ReshardError:
        return False
    return fingerprint is None or manifest.fingerprint == fingerprint


def latest_is(destination: str, tag: str) -> bool:
    try:
        with open(os.path.join(destination, LATEST)) as fd:
            return fd.read() == tag
    except OSError:
        return False


class Lifecycle:
    """One output's lifecycle on one worker (see the module docstring for the call order).

    `leader`: this worker runs the destination steps (worker 0; in a node-local job, each node's
    first worker for its own DST). `peers`: the workers whose hashes make up the leader's output
    (None: every worker)."""

    def __init__(self, destination: str, tag: str, *, leader: bool, overwrite: bool = False, words: Words = RESHARD,
                 peers: tuple[int, ...] | None = None, resume: ResumeByRounds | ResumeByFile = BY_ROUNDS):
        self.destination, self.leader, self.overwrite, self.words, self.peers = destination, leader, overwrite, words, peers
        self.resume = resume
        self.staging = Staging(destination, tag)
        self.lock = DestinationLock(resume.lock_dir or destination)
        self.start: Start | None = None
        self.rounds_started = False
        """Set once the work began writing what a resume continues: a failure then keeps the staging."""

    # 1.
    def decide(self, describe: Callable[[], JobOutput], allow_complete: bool = True) -> Start:
        """The leader's decision (step 1), an OSError reported as the destination's."""
        try:
            return decide_start(self.destination, self.staging.tag, describe(), self.lock, self.overwrite,
                                self.words, allow_complete, self.resume)
        except OSError as error:
            detail = f"{error.filename}: {error.strerror}" if error.filename else error.strerror
            raise OptionError(f"{self.destination}: cannot be created or written ({detail})") from None

    def begin(self, transport, describe: Callable[[], JobOutput]) -> Start:
        """Step 1 with worker 0 as the leader: every worker receives its Start, or its error."""
        self.start = on_rank0(transport, lambda: self.decide(describe))
        return self.start

    def begin_per_node(self, transport, node: int, describe: Callable[[], JobOutput]) -> Start:
        """Step 1 in a node-local job: each node's leader decides for its own DST; every worker learns
        all the starts. The output is complete only when every node's is (a complete node otherwise
        starts over with the others), and the rounds resume from the first round some node has not done."""
        def gather(work):
            outcome = None
            if self.leader:
                try:
                    outcome = ("ok", (node, work()))
                except ReshardError as error:
                    outcome = ("error", error)
                except Exception as error:
                    outcome = ("error", PeerFailure(f"worker {transport.rank} failed: {type(error).__name__}: {error}"))
            outcomes = transport.all_gather_object(outcome)
            errors = [o[1] for o in outcomes if o is not None and o[0] == "error"]
            if errors:
                if outcome is not None and outcome[0] == "ok" and outcome[1][1].mode != "complete":
                    clean_up_after_failure(self.staging, self.lock, keep_staging=False,
                                           remove_destination=outcome[1][1].created_destination)
                raise errors[0]
            return dict(o[1] for o in outcomes if o is not None)

        starts = gather(lambda: self.decide(describe))
        if any(s.mode == "complete" for s in starts.values()) and not all(s.mode == "complete" for s in starts.values()):
            starts = gather(lambda: self.decide(describe, False) if starts[node].mode == "complete" else starts[node])
        mine = starts.get(node) or next(iter(starts.values()))
        notes = [f"node {n}: {note}" for n, s in sorted(starts.items()) for note in s.notes]
        self.start = replace(mine, rounds_done=min(s.rounds_done for s in starts.values()), notes=notes,
                             skeletons=mine.skeletons if node in starts else False)
        return self.start

    # 2.
    def opened(self) -> None:
        """Every worker's files exist: journal it (a resume reopens them) unless they were reopened."""
        if self.leader and not self.start.skeletons:
            write_journal(self.staging.tag_dir, self.start.plan_fingerprint, True, 0)
        self.rounds_started = True

    def journal(self, rounds_done: int) -> None:
        """The rounds before `rounds_done` are durable on every worker."""
        if self.leader:
            write_journal(self.staging.tag_dir, self.start.plan_fingerprint, True, rounds_done)

    # 3.
    def publish(self, transport, hashes, place: Callable[[list], None]) -> None:
        """Gather every worker's `hashes`; the leader runs `place(hashes of its peers)`; all agree."""
        all_hashes = transport.all_gather_object(hashes)
        failure = None
        if self.leader:
            try:
                place(all_hashes if self.peers is None else [all_hashes[worker] for worker in self.peers])
            except OSError as error:
                failure = ReshardError(f"{self.destination}: {self.words.publishing} failed: {error}")
            except Exception as error:
                failure = error
        check_peers(transport, failure, self.words.publishing)

    # 4.
    def run(self, work: Callable[[], object]):
        """Run the work (steps 2-3); clean up after a failure, release the lock after success."""
        try:
            result = work()
        except BaseException as error:
            removed, kept = False, self.resume.keeps_staging(self.rounds_started)
            if self.leader:
                removed = clean_up_after_failure(self.staging, self.lock, keep_staging=kept,
                                                 remove_destination=self.start.created_destination)
                self.resume.released(self.lock)
            if isinstance(error, OSError):  # journal, manifest or publish writes: reported like the others
                error = WriteFailed(error.filename or self.staging.tag_dir, error)
            if isinstance(error, ReshardError):
                text = str(error)
                if isinstance(error, WriteFailed) and self.start.output_bytes and is_disk_full(error.error, error.path):
                    text = (f"{error.path}: writing failed ({error.error.strerror or 'disk full'}): "
                            f"{disk_full_message(self.destination, self.start.output_bytes)}")
                error.args = (text + self.resume.what_was_kept(self.staging, kept, removed, error),)
                raise error from None
            raise
        if self.leader:
            self.lock.release()
            self.resume.released(self.lock)
        return result
