"""rft_jax/environments: skyrl-gym's API, the guess-the-number game, the registry, the output
check, the workers (parallel, errors, timeouts recovered by replay, bad outputs) and the bound on
a step's environment faults.

One pool of three workers serves the module; each test closes its trajectories, so a new
trajectory is pinned to the least-loaded worker as if the pool were fresh.
"""

import concurrent.futures
import itertools
import math
import sys
import time

import numpy as np
import pytest

import rft_jax.environments as E
from rft_jax.environments import registry
from rft_jax.environments.guess_number import HIGH, LOW

STEP_TIMEOUT_S = 2.0
SCRIPTED = E.EnvironmentSpec("env_fixtures:ScriptedEnv")
GSM8K_ROW = {"reward_spec": {"ground_truth": "72"}, "extra_info": {}, "max_turns": 3}
GSM8K_ACTIONS = ["Each box holds 8, so 8 * 8 = 64.\n#### 64", "I missed one box: 9 * 8.\n#### 72"]
_ids = itertools.count()


@pytest.fixture(scope="module")
def workers():
  with E.EnvironmentWorkers(3, step_timeout_s=STEP_TIMEOUT_S, startup_timeout_s=120) as pool:
    yield pool


def started(workers, spec, n, **extras):
  """``n`` new trajectories of ``spec``, each started and checked ok: their ids."""
  ids = [next(_ids) for _ in range(n)]
  futures = [workers.start(t, spec, [{"role": "user", "content": "go"}], {"name": f"t{t}", **extras})
             for t in ids]
  for future in futures:
    assert future.result(timeout=120).status == "ok"
  return ids


# ----------------------------------------------------------------------------- guess_number

def play(env, choose):
  """Plays until done; ``choose(lo, hi)`` picks each guess. The (reward, done, reply) per turn."""
  lo, hi, turns = LOW, HIGH, []
  while not turns or not turns[-1][1]:
    guess = choose(lo, hi)
    out = E.check_step_output(env.step(f"My guess is {guess}."), "guess_number")
    reply = out["observations"][0]["content"] if out["observations"] else None
    turns.append((out["reward"], out["done"], reply))
    lo, hi = (guess + 1, hi) if reply == "Higher." else (lo, guess - 1) if reply == "Lower." else (lo, hi)
  return turns


def test_binary_search_wins_every_secret_within_seven_turns():
  for secret in range(LOW, HIGH + 1):
    env = E.GuessNumber(extras={"secret": secret})
    turns = play(env, lambda lo, hi: (lo + hi) // 2)
    assert turns[-1] == (1.0, True, None), secret
    assert len(turns) <= 7 and all(t[:2] == (0.0, False) for t in turns[:-1]), (secret, turns)


def test_guess_number_replies_and_runs_out_of_turns():
  env = E.GuessNumber(extras={"secret": 40, "max_turns": 4})
  messages, _ = env.init([])
  assert "1 to 64" in messages[0]["content"]
  replies = [env.step(a) for a in ("30, no: 50", "no idea", "99", "41")]
  assert [r["observations"] for r in replies[:3]] == [
      [{"role": "user", "content": "Lower."}],  # the last integer counts
      [{"role": "user", "content": "Please end your answer with a whole number from 1 to 64."}],
      [{"role": "user", "content": "Please end your answer with a whole number from 1 to 64."}]]
  assert [(r["reward"], r["done"]) for r in replies] == [(0.0, False)] * 3 + [(0.0, True)]
  assert replies[-1]["observations"] == []
  shaped = E.GuessNumber(env_config={"guess_reward": 0.05}, extras={"secret": 40})
  assert shaped.step("39")["reward"] == 0.05 and shaped.step("x")["reward"] == 0.0


def test_guess_number_secret_from_the_row():
  assert E.GuessNumber(extras={"seed": 7}).secret == E.GuessNumber(extras={"seed": 7}).secret
  assert len({E.GuessNumber(extras={"seed": s}).secret for s in range(20)}) > 5
  with pytest.raises(ValueError, match="secret.*or a seed"):
    E.GuessNumber(extras={})
  with pytest.raises(ValueError, match=r"not in \[1, 64\]"):
    E.GuessNumber(extras={"secret": 65})


# ----------------------------------------------------------------------------- the output check

GOOD = {"observations": [{"role": "user", "content": "hi"}], "reward": 1, "done": False}


@pytest.mark.parametrize("change, message", [
    ({"observations": "hi"}, "observations='hi': not a list of chat messages"),
    ({"observations": [{"role": "user"}]}, r"observations\[0\]\['content'\]=None: not a string"),
    ({"observations": [["user", "hi"]]}, r"observations\[0\]=\['user', 'hi'\]: not a dict"),
    ({"reward": float("nan")}, "reward=nan: not a finite real number"),
    ({"reward": float("-inf")}, "reward=-inf: not a finite real number"),
    ({"reward": True}, "reward=True: not a finite real number"),
    ({"reward": "1"}, "reward='1': not a finite real number"),
    ({"done": 1}, "done=1: not a bool"),
    ({"metadata": ["x"]}, r"metadata=\['x'\]: not a dict"),
    ({"postprocessed_action": 3}, "postprocessed_action=3: not a string"),
])
def test_check_step_output_names_the_bad_field(change, message):
  with pytest.raises(E.EnvironmentOutputError, match="^environment 'my_env' (step )?returned " + message) as e:
    E.check_step_output({**GOOD, **change}, "my_env")
  assert "\n" not in str(e.value)


def test_check_step_output_normalises_what_is_valid():
  out = E.check_step_output({**GOOD, "reward": np.float32(0.5), "done": np.bool_(True), "metadata": None},
                            "my_env")
  assert out == {**GOOD, "reward": 0.5, "done": True, "metadata": {}}
  assert type(out["reward"]) is float and type(out["done"]) is bool
  with pytest.raises(E.EnvironmentOutputError, match="step returned no reward, done"):
    E.check_step_output({"observations": []}, "my_env")
  with pytest.raises(E.EnvironmentOutputError, match="step returned 'text': not a dict"):
    E.check_step_output("text", "my_env")


# ----------------------------------------------------------------------------- the registry

def test_registry_names(monkeypatch):
  with pytest.raises(ValueError, match=r"unknown environment 'nope': the builtins are \['guess_number'"):
    E.make_environment(E.EnvironmentSpec("nope"), {})
  assert isinstance(E.make_environment(E.EnvironmentSpec("guess_number"), {"secret": 3}), E.GuessNumber)
  assert isinstance(E.make_environment(SCRIPTED, {}), E.Environment)
  monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
  E.register_environment("scripted", "env_fixtures:ScriptedEnv")
  assert "scripted" in E.registered_names()
  with pytest.raises(ValueError, match="already registered"):
    E.register_environment("scripted", E.GuessNumber)
  with pytest.raises(ValueError, match="without ':'"):
    E.register_environment("a:b", E.GuessNumber)


def test_skyrl_gym_missing_names_the_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, "skyrl_gym", None)
  with pytest.raises(ImportError, match=r"needs skyrl-gym.*pip install 'rft_jax\[agents\]'") as e:
    E.make_environment(E.EnvironmentSpec("skyrl_gym:gsm8k"), GSM8K_ROW)
  assert "\n" not in str(e.value)


def transcript(outputs):
  return [(o["observations"], o["reward"], o["done"]) for o in outputs]


@pytest.mark.timeout(180)
def test_skyrl_gym_environment_runs_unchanged_in_the_workers():
  """(Workers of their own: the first start imports skyrl-gym and pandas in the worker, seconds on
  a loaded machine, which the shared pool's 2-second limit would call a timeout.)"""
  from skyrl_gym.envs.gsm8k.multi_turn_env import GSM8kMultiTurnEnv

  prompt = [{"role": "user", "content": "8 boxes of 9 eggs: how many eggs?"}]
  direct = GSM8kMultiTurnEnv(env_config={}, extras=GSM8K_ROW)
  assert direct.init(prompt) == (prompt, {})
  expected = transcript([direct.step(a) for a in GSM8K_ACTIONS])
  assert [r for _, r, _ in expected] == [pytest.approx(0.2 / 3), 1.0] and expected[-1][2]
  spec = E.EnvironmentSpec("skyrl_gym:gsm8k_multi_turn")
  t = next(_ids)
  with E.EnvironmentWorkers(1, step_timeout_s=120, startup_timeout_s=120) as workers:
    begun = workers.start(t, spec, prompt, GSM8K_ROW).result(timeout=150)
    assert begun == E.Outcome("ok", {"observations": prompt, "reward": 0.0, "done": False,
                                     "metadata": {}})
    got = [workers.step(t, a).result(timeout=150) for a in GSM8K_ACTIONS]
    workers.close(t)
  assert [o.status for o in got] == ["ok", "ok"]
  assert transcript([o.output for o in got]) == expected


@pytest.mark.timeout(120)
def test_a_builtin_registered_in_the_trainer_reaches_the_workers(workers, monkeypatch):
  monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
  E.register_environment("scripted", sys.modules["env_fixtures"].ScriptedEnv)
  (t,) = started(workers, E.EnvironmentSpec("scripted"), 1)
  out = workers.step(t, "a").result(timeout=30)
  workers.close(t)
  assert out.status == "ok" and out.output["observations"][0]["content"].endswith("turn 1: ['a']")
  meta = out.output["metadata"]
  assert (meta["cuda"], meta["jax_platforms"], meta["jax_imported"]) == ("", "cpu", False)


# ----------------------------------------------------------------------------- the workers

@pytest.mark.timeout(120)
def test_trajectories_step_in_parallel_and_answer_as_they_finish(workers):
  ids = started(workers, SCRIPTED, 3)
  assert sorted(workers.worker_of(t) for t in ids) == [0, 1, 2]
  t0 = time.monotonic()
  futures = {workers.step(t, f"sleep:{s}"): t for t, s in zip(ids, (1.0, 1.0, 0.2))}
  order = [futures[f] for f in concurrent.futures.as_completed(futures, timeout=30)]
  elapsed = time.monotonic() - t0
  for t in ids:
    workers.close(t)
  assert order[0] == ids[2]  # the short step answered first
  assert all(f.result().status == "ok" for f in futures)
  assert elapsed < 2.0, elapsed  # one after another: 2.2 s


@pytest.mark.timeout(120)
def test_an_environment_that_raises_leaves_its_worker_and_trajectory(workers):
  (t,) = started(workers, SCRIPTED, 1)
  restarts = workers.restarts
  first = workers.step(t, "a").result(timeout=30)
  raised = workers.step(t, "raise").result(timeout=30)
  after = workers.step(t, "b").result(timeout=30)
  workers.close(t)
  assert raised == E.Outcome("error", None, "ValueError: bad action 'raise'")
  assert after.status == "ok" and after.output["metadata"]["pid"] == first.output["metadata"]["pid"]
  assert after.output["observations"][0]["content"].endswith("turn 2: ['a', 'b']")
  assert workers.restarts == restarts
  failed = workers.start(next(_ids), E.EnvironmentSpec(SCRIPTED.name, {"fail_to_construct": True}), [], {})
  assert failed.result(timeout=30) == E.Outcome("error", None, "RuntimeError: cannot construct this one")
  with pytest.raises(ValueError, match="unknown environment 'nope'"):
    workers.start(next(_ids), E.EnvironmentSpec("nope"), [], {})


@pytest.mark.timeout(120)
def test_bad_outputs_are_reported_and_the_worker_lives_on(workers):
  (t,) = started(workers, SCRIPTED, 1)
  nan, text = (workers.step(t, a).result(timeout=30) for a in ("nan", "not_a_list"))
  fine = workers.step(t, "c").result(timeout=30)
  workers.close(t)
  assert nan.status == "bad_output" and "returned reward=nan: not a finite real number" in nan.error
  assert text.status == "bad_output" and "returned observations='just text'" in text.error
  assert fine.status == "ok"


@pytest.mark.timeout(120)
def test_a_timeout_kills_the_worker_and_its_other_trajectories_are_replayed(workers):
  ids = started(workers, SCRIPTED, 6)
  hung = ids[0]
  mates = [t for t in ids[1:] if workers.worker_of(t) == workers.worker_of(hung)]
  (mate,) = mates
  unseeded = started(workers, E.EnvironmentSpec("env_fixtures:UnseededEnv"), 3)
  (lost,) = [t for t in unseeded if workers.worker_of(t) == workers.worker_of(hung)]
  before = [workers.step(t, a).result(timeout=30) for t, a in ((mate, "a"), (mate, "raise"), (mate, "b"),
                                                               (lost, "a"))]
  assert [o.status for o in before] == ["ok", "error", "ok", "ok"]
  restarts = workers.restarts
  t0 = time.monotonic()
  timed_out = workers.step(hung, "hang").result(timeout=30)
  elapsed = time.monotonic() - t0
  assert timed_out.status == "timeout" and "no answer within 2 s" in timed_out.error
  assert STEP_TIMEOUT_S <= elapsed < STEP_TIMEOUT_S + 1.5, elapsed
  assert workers.restarts == restarts + 1
  with pytest.raises(ValueError, match=f"trajectory {hung} is not running"):
    workers.step(hung, "again")
  assert workers.close(hung).result(timeout=1) == E.Outcome("ok")
  after = workers.step(mate, "c").result(timeout=60)  # replayed on the new worker: a, raise, b
  assert after.status == "ok", after
  assert after.output["observations"][0]["content"].endswith("turn 3: ['a', 'b', 'c']")
  assert after.output["metadata"]["pid"] != before[0].output["metadata"]["pid"]
  gone = workers.step(lost, "b").result(timeout=60)
  assert gone.status == "error" and "could not be restored" in gone.error and "diverged" in gone.error
  for t in ids[1:] + unseeded:
    assert workers.close(t).result(timeout=30).status == "ok"


@pytest.mark.timeout(120)
def test_a_worker_that_dies_is_an_error_and_its_other_trajectories_survive(workers):
  ids = started(workers, SCRIPTED, 4)
  mate = next(t for t in ids[1:] if workers.worker_of(t) == workers.worker_of(ids[0]))
  workers.step(mate, "a").result(timeout=30)
  died = workers.step(ids[0], "exit").result(timeout=30)
  after = workers.step(mate, "b").result(timeout=60)
  for t in ids:
    workers.close(t)
  assert died == E.Outcome("error", None, "worker exited (exit code 3)")
  assert after.status == "ok" and after.output["observations"][0]["content"].endswith("turn 2: ['a', 'b']")


# ----------------------------------------------------------------------------- the fault bound

def test_fault_fraction_bound():
  outcomes = ([E.Outcome("ok")] * 9 + [E.Outcome("error")] * 3 + [E.Outcome("timeout")] * 2
              + [E.Outcome("bad_output")] * 2)
  counts = E.EnvironmentCounts.of(outcomes)
  assert (counts.failed, counts.total) == (7, 16)
  with pytest.raises(E.EnvironmentFaultError) as e:
    E.check_fault_fraction(counts, 0.25, "guess_number")
  assert str(e.value).startswith(
      "environment guess_number failed or timed out in 7 of 16 calls (44%) this step (3 errors: raised "
      "or its worker died; 2 timeouts; 2 bad outputs), above the limit of 25%")
  assert "\n" not in str(e.value)
  E.check_fault_fraction(E.EnvironmentCounts(ok=12, error=4), 0.25, "guess_number")  # at the limit
  E.check_fault_fraction(E.EnvironmentCounts(), 0.0, "guess_number")  # no calls
  with pytest.raises(ValueError, match=r"in \[0, 1\]"):
    E.check_fault_fraction(counts, 25, "guess_number")
  assert counts.metrics() == {"env/ok": 9, "env/error": 3, "env/timeout": 2, "env/bad_output": 2}
  assert math.isclose(counts.failed / counts.total, 0.4375)
