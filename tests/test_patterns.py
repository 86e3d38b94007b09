"""The seven patterns on real sandboxes: who wins, who is closed, what is recorded."""

from __future__ import annotations

import time

import pytest

from branchbox import Sandbox
from branchbox.patterns import (
    Outcome,
    PatternTimeout,
    beam_search,
    best_of_n,
    cascaded,
    reflexion,
    speculate,
    tournament,
    tree_of_thoughts,
)

# One backend is enough here: the patterns only use the SDK, which both backends serve alike.
pytestmark = pytest.mark.parametrize("harness", ["btrfs"], indirect=True)


@pytest.fixture
def parent(harness) -> Sandbox:
    with harness.sandbox() as sb:
        sb.run_code("mark = 'parent'")
        yield sb


def only_parent_left(harness, parent: Sandbox, outcome: Outcome) -> None:
    """Every fork is closed (or merged): the engine holds the parent alone."""
    assert list(harness.engine.live) == [parent.id]
    assert all(c.status != "running" for c in outcome.candidates)


def shell(child: Sandbox, cmd: str) -> int | None:
    return child.exec(cmd).exit_code


def test_speculate_first_success_wins_and_the_rest_are_killed(harness, parent) -> None:
    candidates = [
        lambda child, i: shell(child, "sleep 30; echo slow > /root/who"),
        lambda child, i: shell(child, "exit 3"),
        lambda child, i: shell(child, "sleep 0.5; echo fast > /root/who"),
    ]
    started = time.monotonic()
    outcome = speculate(parent, candidates, success=lambda child, code: code == 0)
    assert time.monotonic() - started < 15  # the 30 s loser was killed, not waited for
    assert outcome.winner is outcome.candidates[2]
    assert [c.status for c in outcome.candidates] == ["aborted", "lost", "won"]
    assert [c.score for c in outcome.candidates] == [None, 0.0, 1.0]
    assert outcome.candidates[1].result == 3
    assert parent.files.read("/root/who") == b"fast\n"
    assert parent.run_code("mark").text == "'parent'"  # the winner carried the memory
    assert all(c.sandbox_id.startswith("sbx_") for c in outcome.candidates)
    only_parent_left(harness, parent, outcome)


def test_speculate_without_a_success_leaves_the_parent_alone(harness, parent) -> None:
    def fail(child: Sandbox, i: int) -> None:
        child.exec("touch /root/dirty")
        raise RuntimeError(f"candidate {i} broke")

    outcome = speculate(parent, [fail, fail])
    assert outcome.winner is None and outcome.result is None
    assert [c.status for c in outcome.candidates] == ["failed", "failed"]
    assert str(outcome.candidates[1].error) == "candidate 1 broke"
    assert not parent.files.exists("/root/dirty")
    only_parent_left(harness, parent, outcome)


def test_best_of_n_runs_in_parallel_and_ties_go_to_the_lowest_index(harness, parent) -> None:
    scores = {0: 1.0, 1: 3.0, 2: 3.0}

    def task(child: Sandbox, i: int) -> int:
        child.exec(f"sleep 1; echo {i} > /root/attempt")
        if i == 3:
            raise ValueError("no luck")
        return i

    def score(child: Sandbox, result: int) -> float:
        assert child.files.read("/root/attempt") == f"{result}\n".encode()  # scored in place
        return scores[result]

    started = time.monotonic()
    outcome = best_of_n(parent, n=4, task=task, score=score)
    assert time.monotonic() - started < 3.5  # four 1 s candidates at once, not one by one
    assert outcome.winner is outcome.candidates[1] and outcome.result == 1
    assert [c.status for c in outcome.candidates] == ["lost", "won", "lost", "failed"]
    assert isinstance(outcome.candidates[3].error, ValueError)
    assert outcome.candidates[3].score is None
    assert all(c.duration >= 1 for c in outcome.candidates)
    assert len({c.sandbox_id for c in outcome.candidates}) == 4
    assert parent.files.read("/root/attempt") == b"1\n"
    only_parent_left(harness, parent, outcome)


def test_best_of_n_a_large_result_does_not_block(harness, parent) -> None:
    def task(child: Sandbox, i: int) -> bytes:
        child.exec("head -c 48M /dev/urandom > /root/big")
        return child.files.read("/root/big")

    outcome = best_of_n(parent, n=2, task=task, score=lambda child, data: len(data))
    assert all(len(c.result) == 48 << 20 for c in outcome.candidates)
    assert outcome.winner is outcome.candidates[0]
    only_parent_left(harness, parent, outcome)


def test_timeout_closes_everything_and_leaves_the_parent_alone(harness, parent) -> None:
    def task(child: Sandbox, i: int) -> None:
        child.exec("touch /root/dirty; sleep 60")

    started = time.monotonic()
    with pytest.raises(PatternTimeout) as caught:
        best_of_n(parent, n=3, task=task, score=lambda child, result: 1.0, timeout=1)
    assert time.monotonic() - started < 15
    outcome = caught.value.outcome
    assert isinstance(caught.value, TimeoutError) and outcome.winner is None
    assert [c.status for c in outcome.candidates] == ["timed_out"] * 3
    assert not parent.files.exists("/root/dirty")
    only_parent_left(harness, parent, outcome)


def test_reflexion_feeds_each_critique_to_the_next_attempt(harness, parent) -> None:
    seen: list[str | None] = []

    def task(child: Sandbox, attempt: int, feedback: str | None) -> int:
        seen.append(feedback)
        assert not child.files.exists("/root/tries")  # every attempt starts from the parent
        child.exec(f"echo {attempt} > /root/tries")
        if attempt == 0:
            raise RuntimeError("crashed")
        return attempt

    outcome = reflexion(parent, task=task, retries=3,
                        success=lambda child, attempt: attempt == 2,
                        critique=lambda child, attempt: f"attempt {attempt} was too small")
    assert seen == [None, "RuntimeError: crashed", "attempt 1 was too small"]
    assert outcome.winner is outcome.candidates[2] and outcome.result == 2
    assert [c.round for c in outcome.candidates] == [0, 1, 2]  # it stopped at the success
    assert [c.status for c in outcome.candidates] == ["failed", "lost", "won"]
    assert parent.files.read("/root/tries") == b"2\n"
    only_parent_left(harness, parent, outcome)


def test_reflexion_gives_up_after_its_retries(harness, parent) -> None:
    outcome = reflexion(parent, task=lambda child, attempt, feedback: attempt, retries=1,
                        success=lambda child, attempt: False)
    assert outcome.winner is None
    assert [c.feedback for c in outcome.candidates] == ["0", "1"]  # str(result) by default
    only_parent_left(harness, parent, outcome)


def test_cascaded_widens_until_a_wave_succeeds(harness, parent) -> None:
    feedbacks: dict[int, list[str]] = {}

    def task(child: Sandbox, index: int, feedback: list[str]) -> int:
        feedbacks[index] = feedback
        child.exec(f"sleep {0.2 if index == 2 else 0}; echo {index} > /root/fix")
        return index

    outcome = cascaded(parent, task=task, widths=(1, 2, 4),
                       success=lambda child, index: index == 2,
                       critique=lambda child, index: f"{index} failed")
    assert feedbacks == {0: [], 1: ["0 failed"], 2: ["0 failed"]}
    assert [c.round for c in outcome.candidates] == [0, 1, 1]  # the third wave never ran
    assert outcome.winner is outcome.candidates[2]
    assert [c.status for c in outcome.candidates] == ["lost", "lost", "won"]
    assert parent.files.read("/root/fix") == b"2\n"
    only_parent_left(harness, parent, outcome)


def thought(child: Sandbox, path: tuple[int, ...]) -> str:
    """A step of a search: append this branch to a trail the fork inherits from its parent."""
    child.exec(f"echo -n {path[-1]} >> /root/trail")
    return child.files.read("/root/trail").decode()


def test_tree_of_thoughts_keeps_the_best_node_of_the_tree(harness, parent) -> None:
    values = {"0": 5.0, "1": 2.0, "00": 4.0, "01": 9.0}  # "1" is pruned by the threshold

    outcome = tree_of_thoughts(parent, step=thought, evaluate=lambda child, trail: values[trail],
                               branching=2, depth=2, threshold=3.0)
    trails = [c.result for c in outcome.candidates]
    assert trails == ["0", "1", "00", "01"]  # nested: each child carries its parent's trail
    assert [c.path for c in outcome.candidates] == [(0,), (1,), (0, 0), (0, 1)]
    assert outcome.winner is outcome.candidates[3]
    assert parent.files.read("/root/trail") == b"01"
    only_parent_left(harness, parent, outcome)


def test_tree_of_thoughts_a_worse_child_does_not_replace_its_parent(harness, parent) -> None:
    values = {"0": 5.0, "1": 5.0, "00": 1.0, "01": 1.0, "10": 5.0, "11": 1.0}
    outcome = tree_of_thoughts(parent, step=thought, evaluate=lambda child, trail: values[trail])
    assert outcome.result == "0"  # ties of 5.0 go to the lowest index: the shallow "0"
    assert parent.files.read("/root/trail") == b"0"
    only_parent_left(harness, parent, outcome)


def test_beam_search_keeps_the_best_of_each_level(harness, parent) -> None:
    values = {"0": 1.0, "1": 3.0, "2": 3.0, "10": 2.0, "11": 8.0, "12": 1.0,
              "20": 8.0, "21": 0.0, "22": 1.0}

    def step(child: Sandbox, path: tuple[int, ...]) -> str:
        if path == (2, 2):
            raise RuntimeError("dead end")
        return thought(child, path)

    outcome = beam_search(parent, step=step, evaluate=lambda child, trail: values[trail],
                          width=2, branching=3, depth=2)
    by_trail = {c.result: c for c in outcome.candidates if c.ok}
    assert set(by_trail) == {"0", "1", "2", "10", "11", "12", "20", "21"}
    assert outcome.result == "11"  # 8.0 ties with "20"; "11" has the lower index
    assert by_trail["0"].status == "lost"  # not in the first beam
    assert sum(c.status == "failed" for c in outcome.candidates) == 1
    assert parent.files.read("/root/trail") == b"11"
    only_parent_left(harness, parent, outcome)


def test_tournament_eliminates_pairwise_with_ties_to_the_lower_index(harness, parent) -> None:
    strengths = [3, 7, 7, 1, 9]
    judged: list[tuple[int, int]] = []

    def task(child: Sandbox, i: int) -> int:
        child.exec(f"echo {i} > /root/entrant")
        if i == 4:
            raise RuntimeError("did not show up")
        return strengths[i]

    def judge(a: Sandbox, a_strength: int, b: Sandbox, b_strength: int) -> bool:
        judged.append((int(a.files.read("/root/entrant")), int(b.files.read("/root/entrant"))))
        return a_strength >= b_strength

    outcome = tournament(parent, n=5, task=task, judge=judge)
    assert sorted(judged) == [(0, 1), (1, 2), (2, 3)]
    assert outcome.winner is outcome.candidates[1]
    assert [c.score for c in outcome.candidates] == [0.0, 2.0, 1.0, 0.0, None]
    assert [c.status for c in outcome.candidates] == ["lost", "won", "lost", "lost", "failed"]
    assert parent.files.read("/root/entrant") == b"1\n"
    only_parent_left(harness, parent, outcome)


def test_a_failing_judge_closes_everything(harness, parent) -> None:
    def judge(a: Sandbox, a_result: int, b: Sandbox, b_result: int) -> bool:
        raise LookupError("judge is out")

    with pytest.raises(LookupError):
        tournament(parent, n=2, task=lambda child, i: i, judge=judge)
    assert list(harness.engine.live) == [parent.id]
