"""Rewards: extraction, math-verify equivalence under a process time limit, schemes.

One verifier pool serves the module (a worker start imports sympy, ~1 s).
"""

from __future__ import annotations

import concurrent.futures
import operator
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from rft_jax import rewards as R
from rft_jax.rewards import Verdict

# 9^(9^(9^9)): math-verify/sympy did not finish it in 120 s (measured, ~135 MB RSS).
HANGS = r"9^{9^{9^{9}}}"
TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def pool():
  with R.make_pool(2) as p:
    p.map(operator.add, [(0, 0)] * 2, 60)  # wait until both workers are ready
    yield p


# ----------------------------------------------------------------------------- extraction

@pytest.mark.parametrize("text,want", [
    (r"so the answer is \boxed{3}.", "3"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces
    (r"\boxed{\frac{\sqrt{3}}{2}} done", r"\frac{\sqrt{3}}{2}"),
    (r"first \boxed{1}, then \boxed{2}", "2"),  # several boxes: the last wins
    (r"\boxed{ 3 }", " 3 "),
    (r"\boxed{3.}", "3."),
    (r"\boxed{-7}", "-7"),
    (r"\fbox{7}", "7"),
    (r"$\boxed {x = 3}$", "x = 3"),
    (r"\boxed 42$", "42"),  # \boxed followed by a single token
    (r"\boxed{\{1,2\}}", r"\{1,2\}"),  # escaped braces do not count
    (r"\boxed{\boxed{5}}", "5"),
    (r"\boxed{a}}", "a"),
    (r"\boxed{}", ""),
    ("The answer is 3.", None),  # no box: no answer, never the whole text
    ("1 2 3 4 5 6 7 8 9 10", None),
    (r"\boxed{\frac{1}{2", None),  # unbalanced (truncated)
    (r"\boxed{2} and finally \boxed{\frac{1", None),  # a broken last box is not replaced by an earlier one
    (r"\boxed", None),
    (r"\boxedfoo{3}", None),
])
def test_last_boxed(text, want):
  assert R.last_boxed(text) == want


@pytest.mark.parametrize("text,want", [
    ("The answer is 42.", "42"),
    (r"so $x = \frac{1}{2}$", r"x = \frac{1}{2}"),
    ("$3$ apples, 12 in total", "12"),
    (r"hence \[ \frac{3}{4} \]", r"\frac{3}{4}"),
    ("1,000 dollars", "1,000"),
    ("it is -2.5", "-2.5"),
    ("no numbers here", None),
])
def test_last_unboxed_answer(text, want):
  assert R.last_unboxed_answer(text) == want


# ----------------------------------------------------------------------------- equivalence

C, W = Verdict.CORRECT, Verdict.WRONG
EQUIVALENCE = [
    # (answer, ground truth, verdict)
    ("0.5", r"\frac{1}{2}", C),
    ("1/2", r"\frac{1}{2}", C),
    (r"\dfrac{1}{2}", r"\frac12", C),
    (r"\tfrac{1}{2}", "0.5", C),
    (r"\frac{1}{2}x", r"\frac{1}{2}", W),
    (r"\sqrt{12}", r"2\sqrt{3}", C),
    (r"\frac{1}{2}\sqrt{3}", r"\frac{\sqrt{3}}{2}", C),
    ("x = 3", "3", C),
    ("3", "x=3", C),
    (" 3 ", "3", C),
    ("3.", "3", C),
    ("$3$", "3", C),
    ("-5", "-5", C),
    ("5", "-5", W),
    ("-5", "5", W),
    ("4", "3", W),
    ("3, 4", "3", W),  # several candidates in one box do not match a single answer
    (r"3 \text{ or } 4", "3", W),
    ("(1,2]", "(1, 2]", C),
    ("[1,2]", "(1,2]", W),
    (r"[0, \infty)", r"[0,\infty)", C),
    (r"\{2, 1\}", r"\{1,2\}", C),
    (r"\left(1,2\right)", "(1,2)", C),
    ("1{,}000", "1000", C),
    ("10.0", "10", C),
    (r"\text{Evelyn}", "Evelyn", C),
    (r"2 \text{ cm}", "2", C),
    (r"\pi", "3.14159", W),
    # math-verify's documented leniencies, pinned so that an upgrade that changes them shows up:
    ("0.5000001", "1/2", C),  # numbers compared after rounding to 6 decimals
    ("0.50001", "1/2", W),
    ("y=3", "3", C),  # an assignment is reduced to its right side
    ("0.1", r"10\%", C),  # a percentage matches both its fraction and its number
    ("10", r"10\%", C),
    ("", "3", W),
    (None, "3", W),  # no box
    ("3", r"we get \boxed{3}", C),  # a ground truth given as a solution: its last box
]


def test_equivalence_table(pool):
  got = R.check_many([(a, g) for a, g, _ in EQUIVALENCE], timeout_s=10, pool=pool)
  bad = [(a, g, w, v) for (a, g, w), v in zip(EQUIVALENCE, got) if v is not w]
  assert not bad, bad


@pytest.mark.parametrize("text,want", [
    (r"\left( \dfrac{1}{2} \right).", r"(\frac{1}{2})"),
    (r"\$5\!\,\text{cm}", "5cm"),
    (r"\textbf{\text{A}}", "A"),
])
def test_normalize_answer(text, want):
  assert R.normalize_answer(text) == want


# ----------------------------------------------------------------------------- time limit

def test_hanging_expression_times_out_and_pool_survives(pool):
  restarts = pool.restarts
  t0 = time.monotonic()
  verdict = R.is_equivalent(HANGS, "1", timeout_s=TIMEOUT_S, pool=pool)
  elapsed = time.monotonic() - t0
  assert verdict is Verdict.TIMEOUT
  assert elapsed < TIMEOUT_S + 2.0, elapsed
  assert pool.restarts == restarts + 1
  # The killed worker was replaced: the pool still answers, and fast.
  t0 = time.monotonic()
  assert R.check_many([("0.5", r"\frac12")] * 4, timeout_s=10, pool=pool) == [C] * 4
  assert time.monotonic() - t0 < 5.0


def test_hanging_expression_really_hangs(pool):
  """Not merely slow: still unfinished at 4 s (it ran past 120 s when measured)."""
  assert R.is_equivalent(HANGS, "1", timeout_s=4.0, pool=pool) is Verdict.TIMEOUT


def test_math_verify_signal_timeout_fails_off_the_main_thread():
  """STYLE pitfall: math-verify's own timeout is signal.alarm, unusable in a thread."""
  import math_verify

  errors = []

  def run():
    try:
      math_verify.verify(math_verify.parse("$1$"), math_verify.parse("$1$"))
    except ValueError as e:
      errors.append(str(e))

  t = threading.Thread(target=run)
  t.start()
  t.join()
  assert errors and "thread" in errors[0]


def test_time_limit_holds_when_called_from_threads(pool):
  """Ours works off the main thread: the limit is a process kill, not a signal."""
  with concurrent.futures.ThreadPoolExecutor(2) as ex:
    t0 = time.monotonic()
    hung = ex.submit(R.is_equivalent, HANGS, "1", timeout_s=TIMEOUT_S, pool=pool)
    fine = ex.submit(R.is_equivalent, "x=3", "3", timeout_s=10, pool=pool)
    assert hung.result() is Verdict.TIMEOUT
    assert fine.result() is Verdict.CORRECT
  assert time.monotonic() - t0 < TIMEOUT_S + 3.0
  # The replacement worker was started from a thread that has now exited; it lives on.
  restarts = pool.restarts
  assert [o.status for o in pool.map(time.sleep, [(0.2,), (0.2,)], 30)] == ["ok", "ok"]
  assert pool.restarts == restarts


# ----------------------------------------------------------------------------- the pool

def test_pool_preserves_order(pool):
  out = pool.map(operator.mul, [(i, i) for i in range(40)], 10)
  assert [o.value for o in out] == [i * i for i in range(40)]
  assert {o.status for o in out} == {"ok"}


def test_pool_reports_errors_and_crashes(pool):
  out = pool.map(operator.truediv, [(1, 2), (1, 0), (3, 4)], 10)
  assert out == [R.Outcome("ok", 0.5), R.Outcome("error", "ZeroDivisionError"), R.Outcome("ok", 0.75)]
  (crash,) = pool.map(os._exit, [(3,)], 10)
  assert crash.status == "error" and "exit code 3" in crash.value
  assert pool.map(operator.add, [(1, 2)], 10) == [R.Outcome("ok", 3)]


def test_pool_rejects_what_it_cannot_send(pool):
  with pytest.raises(TypeError, match="cannot pickle"):
    pool.map(lambda x: x, [(1,)], 10)
  assert pool.map(abs, [(-2,)], 10) == [R.Outcome("ok", 2)]


def test_pool_generic_timeout(pool):
  t0 = time.monotonic()
  out = pool.map(time.sleep, [(30,), (0,)], 0.5)
  assert [o.status for o in out] == ["timeout", "ok"]
  assert time.monotonic() - t0 < 3.0


ORPHAN_SCRIPT = r"""
import sys, threading
from rft_jax import rewards as R

def body():
  pool = R.make_pool(1)
  pool.map(abs, [(1,)], 60)
  print(pool._workers[0].process.pid, flush=True)
  R.is_equivalent(r"9^{9^{9^{9}}}", "1", timeout_s=600, pool=pool)

t = threading.Thread(target=body)  # started off the main thread on purpose
t.start()
t.join()
"""


def test_workers_die_with_a_killed_parent():
  """A SIGKILLed trainer must not leave a worker spinning on a hung check."""
  parent = subprocess.Popen([sys.executable, "-c", ORPHAN_SCRIPT], stdout=subprocess.PIPE, text=True)
  try:
    worker_pid = int(parent.stdout.readline())
    time.sleep(0.5)  # the worker is now inside the hanging check
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
      try:
        os.kill(worker_pid, 0)
      except ProcessLookupError:
        return
      time.sleep(0.1)
    os.kill(worker_pid, 9)
    pytest.fail(f"worker {worker_pid} outlived its killed parent")
  finally:
    parent.kill()


def test_pool_memory_limit():
  with R.make_pool(1, memory_limit_mb=1024) as p:
    out = p.map(bytearray, [(2**31,), (8,)], 30)  # 2 GiB over a 1 GiB limit
    assert out[0] == R.Outcome("error", "MemoryError")
    assert out[1].status == "ok"
    assert R.is_equivalent(r"\frac{6}{4}", "1.5", pool=p) is C
  with pytest.raises(RuntimeError, match="after close"):
    p.map(operator.add, [(1, 2)], 1)


def test_pool_rejects_bad_arguments(pool):
  with pytest.raises(ValueError, match="num_workers must be an int >= 1, got 0"):
    R.TimeLimitedPool(0)
  with pytest.raises(ValueError, match="timeout_s must be > 0, got 0"):
    pool.map(operator.add, [(1, 2)], 0)


# ----------------------------------------------------------------------------- schemes

def test_binary_scheme():
  got = R.binary_reward(np.array([True, False, False]), np.array([True, True, False]),
                        np.array([False, False, True]), np.array([False, True, False]))
  np.testing.assert_array_equal(got, [1.0, 0.0, 0.0])
  assert got.dtype == np.float32


@pytest.mark.parametrize("correct,formatted,unformatted_correct,truncated,want", [
    (True, True, False, False, 1.0),
    (True, True, False, True, 1.0),  # boxed and right, even if it then ran to the limit
    (False, False, True, False, 0.0),  # right answer without a box
    (False, False, True, True, 0.0),
    (False, True, False, True, -1.0),  # wrong and truncated
    (False, False, False, True, -1.0),
    (False, True, False, False, -0.1),  # wrong
    (False, False, False, False, -0.1),
])
def test_paper_appendix_b_scheme(correct, formatted, unformatted_correct, truncated, want):
  got = R.paper_appendix_b_reward(*(np.array([x]) for x in (correct, formatted, unformatted_correct, truncated)))
  assert got.dtype == np.float32
  assert got[0] == pytest.approx(want)


@pytest.mark.parametrize("length,want", [
    (0, 0.0), (80, 0.0),  # L <= L_max - L_cache
    (81, -0.05), (90, -0.5), (99, -0.95),  # linear ramp
    (100, -1.0), (101, -1.0), (10_000, -1.0),  # L_max and beyond
])
def test_dapo_overlong_penalty_breakpoints(length, want):
  got = R.dapo_overlong_penalty([length], max_len=100, cache_len=20)
  assert got.dtype == np.float32
  assert got[0] == pytest.approx(want, abs=1e-6)


def test_dapo_overlong_penalty_rejects_bad_params():
  with pytest.raises(ValueError, match="cache_len=100, max_len=100"):
    R.dapo_overlong_penalty([1], max_len=100, cache_len=100)


BATCH = [
    # (completion, answer, finish_reason, length)
    (r"so \boxed{\frac{1}{2}}", "0.5", "stop", 10),  # right, boxed
    ("The answer is 0.5", "1/2", "stop", 10),  # right, no box
    (r"\boxed{3}", "4", "stop", 10),  # wrong
    ("I think 7 and then", "4", "length", 120),  # wrong, truncated, past L_max
    (r"\boxed{" + HANGS + "}", "1", "stop", 10),  # hangs: timeout, wrong
    (" ".join(str(i) for i in range(1, 101)), "50", "stop", 10),  # listing numbers gains nothing
    (r"\boxed{5}", "5", "length", 90),  # right, on the ramp
]


def test_score_batch_paper_scheme_with_overlong_shaping(pool):
  cfg = R.RewardConfig(scheme="paper_appendix_b", timeout_s=TIMEOUT_S, overlong_shaping=True,
                       overlong_max_len=100, overlong_cache_len=20)
  completions, answers, reasons, lengths = zip(*BATCH)
  t0 = time.monotonic()
  res = R.score_batch(list(completions), list(answers), list(reasons), list(lengths), cfg, pool=pool)
  assert time.monotonic() - t0 < TIMEOUT_S + 3.0
  np.testing.assert_allclose(res.reward, [1.0, 0.0, -0.1, -2.0, -0.1, -0.1, 0.5], atol=1e-6)
  assert res.reward.dtype == np.float32
  np.testing.assert_array_equal(res.correct, [1, 0, 0, 0, 0, 0, 1])
  np.testing.assert_array_equal(res.formatted, [1, 0, 1, 0, 1, 0, 1])
  np.testing.assert_array_equal(res.unformatted_correct, [0, 1, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(res.truncated, [0, 0, 0, 1, 0, 0, 1])
  np.testing.assert_array_equal(res.timed_out, [0, 0, 0, 0, 1, 0, 0])
  assert (res.timeouts, res.errors) == (1, 0)
  m = res.metrics()
  assert m["reward/accuracy"] == pytest.approx(2 / 7) and m["reward/timeouts"] == 1.0


def test_step_budget_bounds_a_batch_of_hanging_answers(pool):
  """12 hanging answers at 30 s each on 2 workers would take 180 s; the batch's budget ends it
  in about 1.5 s, every answer scored as timed out, and says how many the budget cut."""
  budget, n = 1.5, 12
  cfg = R.RewardConfig(timeout_s=30.0, step_time_limit_s=budget)
  t0 = time.monotonic()
  res = R.score_batch([rf"\boxed{{{HANGS}}}"] * n, ["1"] * n, ["stop"] * n, [5] * n, cfg, pool=pool)
  elapsed = time.monotonic() - t0
  assert elapsed < budget + 1.5, elapsed
  assert (res.timeouts, res.over_budget, res.errors) == (n, n, 0) and res.timed_out.all()
  np.testing.assert_array_equal(res.reward, np.zeros(n, np.float32))  # timed out = wrong
  assert res.metrics()["reward/over_budget"] == n
  # A batch within its budget is untouched.
  res = R.score_batch([r"\boxed{\frac12}", r"\boxed{3}"], ["0.5", "4"], ["stop"] * 2, [5] * 2,
                      R.RewardConfig(step_time_limit_s=30.0), pool=pool)
  assert res.correct.tolist() == [True, False] and (res.timeouts, res.over_budget) == (0, 0)


def test_pool_budget_stops_running_calls_and_skips_the_rest(pool):
  pool.map(operator.add, [(0, 0)] * 2, 60)  # the workers of earlier tests' timeouts are up
  t0 = time.monotonic()
  out = pool.map(time.sleep, [(30,)] * 3 + [(0,)], 30, budget_s=0.5)
  assert time.monotonic() - t0 < 2.0
  assert out == [R.Outcome("timeout", R.OVER_BUDGET)] * 4
  assert pool.map(time.sleep, [(30,), (0,)], 0.5, budget_s=10) == [R.Outcome("timeout"), R.Outcome("ok")]
  with pytest.raises(ValueError, match="budget_s must be > 0"):
    pool.map(abs, [(1,)], 10, budget_s=0)


def test_score_batch_binary_never_rewards_unboxed_text(pool):
  rows = [b for b in BATCH if HANGS not in b[0]] + [("The answer is 4", "4", "stop", 5)]
  completions, answers, reasons, lengths = zip(*rows)
  res = R.score_batch(list(completions), list(answers), list(reasons), list(lengths),
                      R.RewardConfig(scheme="binary"), pool=pool)
  np.testing.assert_array_equal(res.reward, [1, 0, 0, 0, 0, 1, 0])
  assert not res.unformatted_correct.any()  # not computed for binary
  empty = R.score_batch([], [], [], [], R.RewardConfig(), pool=pool)
  assert empty.reward.shape == (0,) and empty.timeouts == 0


def test_score_batch_checks_lengths(pool):
  with pytest.raises(ValueError, match=r"len\(answers\)=1 != len\(completions\)=2"):
    R.score_batch(["a", "b"], ["1"], ["stop", "stop"], [1, 1], R.RewardConfig(), pool=pool)


# ----------------------------------------------------------------------------- config

@pytest.mark.parametrize("kwargs,match", [
    (dict(scheme="dapo"), r"rewards\.scheme='dapo' is not one of \['binary', 'paper_appendix_b'\]"),
    (dict(timeout_s=0), r"rewards\.timeout_s must be a number > 0, got 0"),
    (dict(timeout_s="5"), r"rewards\.timeout_s .* got '5'"),
    (dict(num_workers=0), r"rewards\.num_workers must be an int >= 1, got 0"),
    (dict(num_workers=2.5), r"rewards\.num_workers .* got 2\.5"),
    (dict(overlong_shaping="yes"), r"rewards\.overlong_shaping must be a bool, got 'yes'"),
    (dict(overlong_cache_len=0), r"rewards\.overlong_cache_len must be an int >= 1, got 0"),
    (dict(overlong_max_len=4096), r"rewards\.overlong_max_len must be an int > overlong_cache_len=4096, got 4096"),
    (dict(memory_limit_mb=10), r"rewards\.memory_limit_mb .* got 10"),
    (dict(step_time_limit_s=0), r"rewards\.step_time_limit_s must be None or a number > 0, got 0"),
])
def test_config_errors_name_the_field(kwargs, match):
  with pytest.raises(ValueError, match=match):
    R.RewardConfig(**kwargs)


def test_config_is_validated_against_the_registry(monkeypatch):
  monkeypatch.setitem(R.SCHEMES, "always_one", R.RewardScheme(lambda c, f, u, t: np.ones(len(c), np.float32)))
  assert R.RewardConfig(scheme="always_one").scheme == "always_one"


@pytest.mark.parametrize("when", ["starting", "idle"])
def test_pool_replaces_a_worker_that_died_between_batches(pool, when):
  if when == "idle":
    pool.map(time.sleep, [(0.1,)] * 2, 30)  # both workers ready
  else:
    pool.map(time.sleep, [(5,), (0,)], 0.2)  # a replacement is starting now
  victim = next(w for w in pool._workers if w.ready == (when == "idle")).process
  victim.kill()
  victim.wait()
  out = pool.map(operator.add, [(i, 1) for i in range(6)], 10)
  assert [o.value for o in out] == list(range(1, 7))


def test_pool_gives_up_when_workers_cannot_start():
  with R.TimeLimitedPool(1, initializer=sys.exit) as p:
    with pytest.raises(RuntimeError, match="keep exiting during start-up"):
      p.map(abs, [(1,)], 10)


def test_rewards_import_nothing_else_of_the_project():
  code = ("import sys, rft_jax.rewards; "
          "print(sorted(m for m in sys.modules if m.startswith('rft_jax') or m in ('jax', 'sympy')))")
  mods = eval(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
  assert all(m == "rft_jax" or m.startswith("rft_jax.rewards") for m in mods), mods
