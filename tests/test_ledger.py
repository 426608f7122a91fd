"""The trainer's exactly-once collection (ledger.py): RolloutLedger alone, and Collector against a real
in-process parameter server with a fake worker (good, zero-variance, stale and malformed rollouts, duplicates,
a stop mid-collection, a crash between a checkpoint's save and its commit)."""
import threading

import numpy as np
import pytest

import common
import data
import train
import param_server as ps
from train import RolloutLedger


class _FakeQueue:
  """Just the two calls RolloutLedger makes."""

  def __init__(self):
    self.acked, self.requeued = [], []

  def ack(self, queue, ids):
    self.acked += list(ids)

  def requeue(self, queue, ids=None):
    self.requeued += list(ids)


def test_rollout_ledger_consumed_only_when_committed_and_bounded():
  q = _FakeQueue()
  led = RolloutLedger(keep=2)
  led.load_state_dict(dict(count=1, gens=[["a"]]))  # "a" is in the checkpoint we resumed from
  led.resumed(q)  # its ack may not have reached the server before the crash: acked at the restart
  assert q.acked == ["a"]
  q.acked.clear()
  assert led.lease("a") == "acked_dup"
  assert [led.lease(r) for r in ("b", "c", "b")] == ["new", "new", "dup"]
  led.step_done()  # step trained b and c (or skipped one of them): consumed at the next checkpoint
  assert led.lease("d") == "new"
  led.reissued += 1
  assert led.release(q) == 1 and q.requeued == ["d"]  # SIGTERM mid-collection: d goes back untrained
  st = led.state_dict()
  assert st == dict(count=3, gens=[["a"], ["b", "c"]]) and q.acked == []  # d not in it; nothing acked yet
  led.saved()  # written asynchronously: nothing acked before the commit
  assert led.lease("c") == "dup" and q.acked == []
  led.committed(q)
  assert q.acked == ["b", "c"] and len(led) == 3
  assert led.lease("d") == "new" and led.lease("c") == "acked_dup"
  with pytest.raises(AssertionError):
    led.state_dict()  # never mid-collection
  led.step_done()
  for gen in range(3):  # bounded: only the newest `keep` generations of ids are kept
    led.lease(f"x{gen}")
    led.step_done()
    led.saved()
    led.committed(q)
  assert led.state_dict() == dict(count=7, gens=[["x2"], []]) and led.lease("b") == "new"
  with pytest.raises(ValueError, match="RolloutLedger"):
    led.load_state_dict(["s0"])


def wire_rollout(item, version=0, rewards=(1.0, 0.0)):
  """What a worker sends back for a prompt item (data.Rollout on the wire)."""
  p = data.PromptItem.from_wire(item)
  comps = [np.array([5, 6], np.int32) for _ in rewards]
  lps = [np.array([-0.1, -0.2], np.float32) for _ in rewards]
  return data.Rollout(p.id, version, "w0", p.problem, p.prompt_tokens, comps, lps, np.asarray(rewards, np.float32),
                      stats=dict(worker_tok_s=10.0)).to_wire()


def answer(c, how=None):
  """A fake worker's pass over the ready prompts: each gets a rollout (how[id]: its version / rewards, or
  'malformed': no rewards field), then the prompt is acked. Returns the items answered (data.PromptItem)."""
  seen = []
  for it in c.get("prompts", 100):
    h = (how or {}).get(it["id"].split(".")[-1] if it["id"].startswith("c") else it["id"], {})  # curation: c<tag>.<i>
    w = dict(wire_rollout(it, h.get("version", 0), h.get("rewards", (1.0, 0.0))), **h.get("stats", {}))
    if h.get("malformed"):
      del w["rewards"]
    if h.get("nan_logprob"):  # one bad worker chip
      w["logprobs"][0] = np.array([-0.1, np.nan], np.float32)
    c.put("rollouts", [w])
    c.ack("prompts", [it["id"]])
    seen.append(data.PromptItem.from_wire(it))
  return seen


class Stop:
  """stop.requested turns True at its (after+1)-th read."""

  def __init__(self, after=10 ** 9):
    self.after = after

  @property
  def requested(self):
    self.after -= 1
    return self.after < 0


@pytest.fixture
def server():
  s = ps.Server(ps.ServerConfig(token="t")).start()
  yield s
  s.stop()


def collector(server, **kw):
  c = ps.Client(port=server.port, token="t", timeout_s=5.0)
  problems = data.make_task_problems("arithmetic", 40, difficulty=2, seed=0, ops="+")
  args = dict(group_size=2, prefetch_steps=2, lease_s=30.0, wait_s=0.05, max_staleness=1, dynamic_sampling=True,
              band=None)
  args.update(kw)
  encode = lambda p: [2] + [4 + ord(ch) % 20 for ch in p.prompt]  # noqa: E731
  return c, train.Collector(c, data.PromptStream(problems, seed=0), data.PassRateTracker(), encode, **args)


def test_collect_skips_zero_variance_stale_and_malformed_and_acks_only_after_the_commit(server):
  c, col = collector(server)
  col.issue(6)
  items = answer(c, {"s1": dict(rewards=(1.0, 1.0)), "s2": dict(version=-5), "s3": dict(malformed=True),
                     "s4": dict(nan_logprob=True), "s5": dict(stats=dict(stale_regen_tokens=7))})
  assert [it.id for it in items] == ["s0", "s1", "s2", "s3", "s4", "s5"] and items[0].group_size == 2
  assert items[0].prompt_tokens.tolist() == [2] + [4 + ord(ch) % 20 for ch in items[0].problem.prompt]
  got = col.collect(2, 0, Stop())
  assert [g.id for g in got.groups] == ["s0", "s5"] and got.skipped == ["s1", "s2", "s3", "s4"]
  assert (got.zero_var, got.stale, got.malformed, got.duplicates) == (1, 1, 2, 0)
  assert got.groups[0].stats == dict(worker_tok_s=10.0) and got.groups[0].worker == "w0"
  # Generation thrown away, in tokens (2 completions of 2 tokens per group; s5's worker regenerated 7 as stale),
  # and the pacing it drives: 2 of the 3 groups rated were kept, so a step's 2 kept groups need 3 prompts, and
  # --max_staleness=1 allows one step ahead of the current one; with a bound of 4, --prefetch_steps=2 steps.
  assert got.dropped_tokens == dict(stale=4, zero_var=4, worker_stale=7)
  assert col.keep_rate() == pytest.approx(2 / 3) and col.ahead(2) == 3
  col.max_staleness = 4
  assert col.ahead(2) == 6
  col.max_staleness = 1
  # The stale and the malformed rollout's prompts went out again, same prompt, new ids.
  again = {it["id"]: it for it in c.get("prompts", 100) if it["id"].endswith("r")}
  assert sorted(again) == ["s2r", "s3r", "s4r"]  # the NaN rollout's prompt too: nothing lost
  assert again["s2r"]["prompt_tokens"].tolist() == items[2].prompt_tokens.tolist()
  assert not col.tracker.stats  # pass rates count only once the step is trained
  col.step_done()
  assert sorted(col.tracker.stats) == sorted(items[i].problem.id for i in (0, 1, 5))
  assert c.stats()["queues"]["rollouts"]["leased"] == 6  # consumed, but nothing acked before a checkpoint
  st = col.state_dict()
  assert st["consumed"]["count"] == 6 and st["issued"] == col.issued and st["seq"] == col.seq
  col.saved()
  assert c.stats()["queues"]["rollouts"]["leased"] == 6  # written asynchronously: acks wait for the commit
  col.committed()
  q = c.stats()["queues"]["rollouts"]
  assert q["leased"] == q["ready"] == 0
  # Collection leases by the keep rate too: one missing group at 2/3 (the re-issued prompts' rollouts: s4r kept) takes 2 rollouts in one request; the one
  # this step does not need goes back to the queue, untouched, for the next step.
  c.requeue("prompts")  # (the re-issued prompts this test leased above)
  answer(c)
  before = c.stats()["queues"]["rollouts"]["ready"]
  one = col.collect(1, 0, Stop())
  assert len(one.groups) == 1 and not one.skipped
  assert c.stats()["queues"]["rollouts"]["ready"] == before - 1
  assert col.collect(1, 0, Stop()).groups[0].id not in {g.id for g in one.groups}


def test_a_stop_hands_the_partial_batch_back_and_a_restart_trains_each_rollout_once(server):
  c, col = collector(server, dynamic_sampling=False)
  col.issue(4)
  answer(c)
  got = col.collect(6, 0, Stop(after=2))  # SIGTERM before the batch is full
  assert [g.id for g in got.groups] == ["s0", "s1", "s2", "s3"]
  col.hand_back()
  assert c.stats()["queues"]["rollouts"]["ready"] == 4 and not col.tracker.stats  # back, untrained, uncounted
  got = col.collect(4, 0, Stop())  # the same incarnation trains them later, once (requeued at the head)
  assert sorted(g.id for g in got.groups) == ["s0", "s1", "s2", "s3"] and got.duplicates == 0
  col.step_done()
  st = col.state_dict()
  col.saved()  # a crash now: the checkpoint holding s0-s3 is on disk, but they were never acked
  col2 = collector(server, dynamic_sampling=False)[1]
  col2.load_state_dict(st)
  c.requeue("rollouts")  # what the restarted trainer does first
  stop = threading.Event()
  t = threading.Thread(target=lambda: [answer(c) for _ in iter(lambda: stop.wait(0.05), True)], daemon=True)
  t.start()
  try:
    got = col2.collect(4, 0, Stop())
  finally:
    stop.set()
    t.join()
  assert got.duplicates == 4  # recorded by the checkpoint: acked now, never trained twice
  assert sorted(int(g.id[1:]) for g in got.groups) == [4, 5, 6, 7]  # issued ahead before the crash: trained once
  assert c.stats()["queues"]["rollouts"]["leased"] == 4  # only the new ones are held


def test_curation_rates_the_next_prompts_without_consuming_the_stream(server):
  c, col = collector(server, band=(0.0, 1.0))
  head = col.stream.peek(3)
  stop = threading.Event()
  how = {str(i): dict(rewards=r) for i, r in enumerate(((1.0, 1.0), (0.0, 0.0), (1.0, 0.0)))}
  how["3"] = dict(malformed=True)  # logged and left unrated: curation neither crashes nor waits for it
  t = threading.Thread(target=lambda: [answer(c, how) for _ in iter(lambda: stop.wait(0.05), True)], daemon=True)
  t.start()
  try:
    cand, rates = col.curate(4, Stop())
  finally:
    stop.set()
    t.join()
  assert cand == head and rates == {head[0].id: 1.0, head[1].id: 0.0, head[2].id: 0.5}
  assert data.filter_by_pass_rate(cand, rates, *col.band) == [head[2]]  # never and always solved: not kept
  assert col.stream.peek(3) == head and col.seq == 0  # the stream is untouched: curation trains nothing
  assert c.stats()["queues"]["rollouts"]["ready"] == c.stats()["queues"]["rollouts"]["leased"] == 0  # all acked
  col.issue(1)  # the stream's first two prompts are out of the band: skipped, the third is issued as s0
  assert [(it["id"], it["prompt_id"]) for it in c.get("prompts", 10)] == [("s0", head[2].id)]
  assert col.band_skipped == 2


def test_policy_lag_counts_updates_along_the_lineage_across_restarts():
  # A trainer killed after its checkpoint of v40 had published up to v48; its successor re-published v40's weights
  # as v49 (fork [40, 49]), trained v50, v51, v52, then was killed after a checkpoint of v52 with v55 published;
  # the next re-published v52 as v56 (fork [52, 56]) and trained v57, v58. Counted by hand along the lineage
  # 39 -> 40 = 49 -> 50 -> 51 -> 52 = 56 -> 57 -> 58:
  forks = [[40, 49], [52, 56]]
  assert common.policy_lag(58, 58, forks) == 0
  assert common.policy_lag(58, 56, forks) == 2
  assert common.policy_lag(58, 52, forks) == 2  # v52 and v56 are the same weights
  assert common.policy_lag(58, 50, forks) == 4
  assert common.policy_lag(58, 40, forks) == 5
  assert common.policy_lag(58, 39, forks) == 6
  # Dead incarnations' versions: their own updates past the fork point, plus ours since it.
  assert common.policy_lag(58, 54, forks) == (54 - 52) + 2
  assert common.policy_lag(58, 45, forks) == (45 - 40) + 5
  assert common.policy_lag(50, 45, forks[:1]) == (45 - 40) + 1
  assert common.policy_lag(7, 3, []) == 4  # no restart: plain difference
