"""ledger.py: the trainer's side of the queues, exactly once. Issues prompts, leases rollouts, accounts for each.

train.py's loop calls five things (process 0 only; the other trainer processes get the batch by broadcast):

  got = collector.collect(n, version, stop)   lease rollouts until n groups to train on (or a stop)
  collector.hand_back()                       a stop mid-collection: the partial batch goes back untrained
  collector.step_done()                       the step trained them: consumed at the next checkpoint
  collector.saved() / collector.committed()   a checkpoint holding state_dict() was started / is on disk

Design:
  * Exactly once (RolloutLedger): a rollout leased for step s is consumed -- trained, or skipped as stale /
    zero-variance / malformed (listed in the step's `skipped_ids`) -- only once a checkpoint holding step s is
    committed, and only then acked on the server. A trainer killed before that gets the rollouts again (the
    startup `requeue` releases its leases) and trains them once in the surviving lineage; ids recorded by a
    committed checkpoint but not acked before a crash are skipped by id. The record is bounded (see below).
  * Prompts get deterministic ids ("s<seq>") from a resumable data.PromptStream whose cursor is in the
    checkpoint (state_dict), so a restarted trainer re-issues the same ids and the server drops duplicates.
    --prefetch_steps batches are kept issued ahead, so the workers never wait for the trainer.
  * A rollout more than max_staleness versions behind is not trained on: its prompt is re-issued ("<id>r").
    A malformed rollout (data.Rollout.from_wire names the field) is logged and its prompt re-issued when the
    prompt fields are intact. DAPO dynamic sampling drops zero-variance groups; issuing refills.
  * Online curation: prompts whose recent pass rate left the --pass_band are skipped when issuing (at most one
    pass over the stream per draw, so an empty band cannot stall). A prompt the server quarantined (workers
    failed it --max_failures times) counts as consumed without training, once, and is listed in the state.

Run: a library; `pytest tests/test_ledger.py` tests it against a real in-process parameter server.
"""
import dataclasses

import numpy as np
from absl import logging

import data


class RolloutLedger:
  """Which rollout ids this trainer lineage consumed, for exactly-once acks; bounded for runs of any length.

  Bounded: a checkpoint records a count plus the ids of its newest `keep` generations (a generation = the ids
  settled between two checkpoints), not every id ever consumed. That suffices: an id comes back from the server
  only while it is unacked, and a generation is acked right after the checkpoint recording it commits, so after
  a crash the only recorded-but-unacked ids are in the newest generations.
  """

  def __init__(self, keep=3):
    self.keep, self.count, self.gens, self._recorded = keep, 0, [], set()  # as in the newest checkpoint
    self.unacked, self.unacked_notices = [], []  # recorded by a checkpoint not yet committed
    self.settled, self.notices = [], []  # trained / skipped / quarantined in steps done since that checkpoint
    self.batch = []     # leased for the step being collected
    self.reissued = 0   # prompts re-issued (stale) for the step being collected

  def __len__(self):  # every prompt this lineage consumed or holds (leased and not handed back)
    return self.count + len(self.settled) + len(self.notices) + len(self.batch)

  def _held(self, rid):
    return rid in self._recorded or rid in self.batch or rid in self.settled or rid in self.notices

  def lease(self, rid):
    """'acked_dup': in a committed checkpoint but not acked before a crash (ack it again); 'dup': leased twice
    in this incarnation (a lease expired) or in a checkpoint still being committed; 'new': now part of the step
    being collected."""
    if rid in self._recorded and rid not in self.unacked:
      return "acked_dup"
    if self._held(rid):
      return "dup"
    self.batch.append(rid)
    return "new"

  def settle_notice(self, rid, client):
    """A quarantine notice for prompt rid: consumed without training, acked after the next checkpoint commits.
    False if rid is already held (its rollout arrived first, or the notice came back after a crash): then the
    notice is only acked, at once."""
    if rid in self.unacked_notices or rid in self.notices:
      return False
    if self._held(rid):
      client.ack("prompts.failed", [rid])
      return False
    self.notices.append(rid)
    return True

  def step_done(self):
    self.settled += self.batch
    self.batch, self.reissued = [], 0

  def release(self, client):
    """A stop mid-collection: the partial batch goes back to the server untrained. Returns the prompts this
    batch had re-issued (the caller un-counts them: the re-issue repeats, deduplicated by id)."""
    if self.batch:
      client.requeue("rollouts", self.batch)
    n, self.batch, self.reissued = self.reissued, [], 0
    return n

  def state_dict(self):
    """What the next checkpoint records: everything settled so far."""
    assert not self.batch, "a checkpoint inside a collection would record untrained rollouts"
    return dict(count=self.count + len(self.settled) + len(self.notices),
                gens=(self.gens + [self.settled + self.notices])[-self.keep:])

  def saved(self):
    """The checkpoint holding state_dict() is being written: its ids wait for the commit to be acked."""
    self.load_state_dict(self.state_dict())
    self.unacked += self.settled
    self.unacked_notices += self.notices
    self.settled, self.notices = [], []

  def committed(self, client):
    """That checkpoint is on disk: ack, and its ids are consumed."""
    if self.unacked:
      client.ack("rollouts", self.unacked)
    if self.unacked_notices:
      client.ack("prompts.failed", self.unacked_notices)
    self.unacked, self.unacked_notices = [], []

  def load_state_dict(self, d):
    if not isinstance(d, dict) or not isinstance(d.get("count"), int) or not isinstance(d.get("gens"), list):
      raise ValueError(f"RolloutLedger.load_state_dict: expected {{count: int, gens: [[ids]]}}, got {str(d)[:80]}")
    self.count, self.gens = d["count"], [list(g) for g in d["gens"]]
    self._recorded = {r for g in self.gens for r in g}


def in_band(tracker, pid, band, min_samples):
  """Online curation: is prompt pid still worth issuing? Unknown or barely sampled prompts are; otherwise its
  recent (EMA) pass rate must lie strictly inside the band (the paper drops always- and never-solved prompts)."""
  st = tracker.stats.get(pid)
  if band is None or st is None or st[0] < min_samples:
    return True
  return band[0] < tracker.ema_rate(pid) < band[1]


@dataclasses.dataclass
class Collected:
  """One step's collection: the groups to train on and what was consumed without training (for metrics)."""
  groups: list = dataclasses.field(default_factory=list)  # data.Rollout
  skipped: list = dataclasses.field(default_factory=list)  # ids: stale (re-issued), zero-variance, malformed
  stale: int = 0
  zero_var: int = 0
  duplicates: int = 0
  malformed: int = 0


class Collector:
  """Process 0's side of the "prompts" / "rollouts" queues (module docstring). `encode(problem)` -> prompt ids;
  `band`: (low, high) pass-rate band of online curation, or None; `lease_s` / `wait_s`: the rollout lease and
  the long-poll wait of each get, in seconds."""

  def __init__(self, client, stream, tracker, encode, *, group_size, prefetch_steps, lease_s, wait_s,
               max_staleness, dynamic_sampling, band):
    self.client, self.stream, self.tracker, self.encode = client, stream, tracker, encode
    self.group_size, self.prefetch_steps, self.lease_s, self.wait_s = group_size, prefetch_steps, lease_s, wait_s
    self.max_staleness, self.dynamic_sampling, self.band = max_staleness, dynamic_sampling, band
    self.ledger = RolloutLedger()
    self.seq = self.issued = self.band_skipped = 0  # prompts given ids / issued / skipped as out of band
    self.quarantined = []  # dict(id, reason, failures) per prompt the server quarantined
    self._rated = []  # (prompt id, rewards) of the step being collected: into the tracker once it is trained

  # -- checkpointed state: flat keys, as train.py's checkpoints have always stored them
  def state_dict(self):
    return dict(seq=self.seq, issued=self.issued, band_skipped=self.band_skipped, quarantined=self.quarantined,
                stream=self.stream.state_dict(), pass_rates=self.tracker.state_dict(),
                consumed=self.ledger.state_dict())

  def load_state_dict(self, st):
    self.seq, self.issued = st["seq"], st["issued"]
    self.band_skipped, self.quarantined = st.get("band_skipped", 0), st.get("quarantined", [])
    self.stream.load_state_dict(st["stream"])
    self.tracker.load_state_dict(st["pass_rates"])
    self.ledger.load_state_dict(st["consumed"])

  # -- the loop's calls
  def collect(self, n, version, stop):
    """Leases rollouts until n groups to train on, or until stop.requested (then the caller hands back)."""
    got = Collected()
    while len(got.groups) < n and not stop.requested:
      self.note_quarantined()
      self.issue(n * self.prefetch_steps)
      for it in self.client.get("rollouts", max_items=n - len(got.groups), wait_s=self.wait_s,
                                lease_s=self.lease_s):
        self._take(it, version, got)
    return got

  def hand_back(self):
    n = len(self.ledger.batch)
    self.issued -= self.ledger.release(self.client)
    self._rated = []  # not trained: must not count in the pass rates
    logging.info("stop requested mid-collection: %d leased rollouts handed back untrained", n)

  def step_done(self):
    self.ledger.step_done()
    for pid, r in self._rated:  # not before: a partial batch handed back on SIGTERM must not count twice
      self.tracker.update(pid, r)
    self._rated = []

  def saved(self):
    self.ledger.saved()

  def committed(self):
    self.ledger.committed(self.client)  # only now are these rollouts durably consumed

  # -- the parts
  def _take(self, it, version, got):
    """One leased rollout: a duplicate, stale, malformed, zero-variance, or one to train on."""
    rid = it["id"]
    if rid.startswith("c"):  # a curation rollout from before a trainer restart: already counted
      self.client.ack("rollouts", [rid])
      return
    seen = self.ledger.lease(rid)
    if seen != "new":
      if seen == "acked_dup":  # recorded by a checkpoint but not acked before a crash
        self.client.ack("rollouts", [rid])
      got.duplicates += 1
      return
    try:
      r = data.Rollout.from_wire(it)
    except ValueError as e:  # consumed without training; its prompt goes out again if it can be read
      logging.error("%s; skipped", e)
      got.malformed += 1
      got.skipped.append(rid)
      try:
        self._reissue(rid, data.PromptItem.from_wire(dict(it, group_size=self.group_size)))
      except ValueError:
        logging.error("rollout %r: its prompt fields are unreadable too; the prompt is not re-issued", rid)
      return
    if version - r.version > self.max_staleness:
      got.stale += 1  # too old to train on: re-issue the prompt under a fresh id
      got.skipped.append(rid)
      self._reissue(rid, r.prompt_item(rid, self.group_size))
      return
    self._rated.append((r.problem.id, r.rewards))  # counted once the step is done
    if self.dynamic_sampling and not data.group_has_signal(r.rewards):
      got.zero_var += 1
      got.skipped.append(rid)
      return
    got.groups.append(r)

  def _reissue(self, rid, item):
    self.client.put("prompts", [dataclasses.replace(item, id=rid + "r").to_wire()])
    self.issued += 1
    self.ledger.reissued += 1

  def issue(self, target):
    """Keeps `target` prompts issued and not yet consumed."""
    items = []
    while self.issued - len(self.ledger) < target:
      items.append(self.prompt_item(f"s{self.seq}", self.next_in_band()).to_wire())
      self.seq += 1
      self.issued += 1
    if items:
      self.client.put("prompts", items)

  def prompt_item(self, pid, problem):
    return data.PromptItem(pid, problem, np.asarray(self.encode(problem), np.int32), self.group_size)

  def next_in_band(self):
    # At most one pass over the stream is skipped, so a band that nothing is inside cannot stall the run.
    for _ in range(len(self.stream.problems)):
      p = self.stream.next()
      if in_band(self.tracker, p.id, self.band, self.group_size):
        return p
      self.band_skipped += 1
    return p

  def note_quarantined(self):
    """Prompts the server quarantined (notices in the queue "prompts.failed") count as consumed without
    training, so issue() sends a replacement; each is recorded once in the checkpointed state and its notice
    acked once that checkpoint commits. Returns how many were new."""
    new = 0
    for it in self.client.get("prompts.failed", max_items=1000, lease_s=self.lease_s):
      if self.ledger.settle_notice(it["id"], self.client):
        self.quarantined.append(dict(id=it["id"], reason=it["reason"], failures=it["failures"]))
        logging.warning("prompt %s quarantined by the server after %d failures: %s", it["id"], it["failures"],
                        it["reason"][:300])
        new += 1
    return new

  def curate(self, n, stop):
    """Offline curation through the workers at the base weights: group_size samples of each of the next n
    prompts of the stream (ids c<i>, scored, never trained on); their pass rates go into the tracker, which
    decides what is issued (in_band). The stream itself stays the whole training set: RL on a small kept subset
    memorises it (measured: a 754-prompt subset, each drawn ~25 times, raised the training reward 0.19 -> 0.47
    and held-out pass@8 fell 36.6% -> 18.8%). Returns (the rated candidates, {problem id: pass rate}); a malformed
    rollout is logged and its prompt left unrated."""
    from tqdm import tqdm
    cand = self.stream.peek(min(n, len(self.stream.problems)))
    for s in range(0, len(cand), 256):  # bounded frames
      self.client.put("prompts", [self.prompt_item(f"c{i}", p).to_wire() for i, p in enumerate(cand[s:s + 256], s)])
    seen = set()
    bar = tqdm(total=len(cand), desc="curation: base pass rates", dynamic_ncols=True, mininterval=1.0)
    while len(seen) < len(cand):
      if stop.requested:  # nothing trained yet: the restarted trainer curates again
        raise SystemExit("stopped during curation")
      for it in self.client.get("rollouts", max_items=64, wait_s=self.wait_s, lease_s=self.lease_s):
        if it["id"].startswith("c") and it["id"] not in seen:
          seen.add(it["id"])
          bar.update(1)
          try:
            r = data.Rollout.from_wire(it)
            self.tracker.update(r.problem.id, r.rewards)
          except ValueError as e:  # its prompt stays unrated, which in_band treats as worth issuing
            logging.error("%s; curation rollout skipped", e)
        self.client.ack("rollouts", [it["id"]])
    bar.close()
    rates = {p.id: r for p in cand if (r := self.tracker.rate(p.id)) is not None}  # not malformed rollouts' prompts
    return [p for p in cand if p.id in rates], rates
