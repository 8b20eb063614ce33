"""A rank's loop (kvik.executor.rank_process.RankLoop) keeps the device busy: when the next step's
message arrives while a step still runs, the rank launches the next one before it collects the
running one; when the running step ends first, its tokens go back at once (a synchronous engine
core waits for them before it sends anything more)."""

from __future__ import annotations

import msgspec

from kvik.executor.rank_process import RankLoop, encode
from kvik.executor.schedule_wire import StepMessage
from kvik.worker.step_io import ModelRunnerOutput


class _Step:
    """A launched step that ends once the device has been asked ``polls_to_end`` times."""

    def __init__(self, index: int, log: list[str], polls_to_end: int) -> None:
        self.index, self.log, self.polls_left = index, log, polls_to_end

    def ready(self) -> bool:
        self.polls_left -= 1
        return self.polls_left < 0

    def collect(self) -> ModelRunnerOutput:
        self.log.append(f"collect {self.index}")
        return ModelRunnerOutput()


class _Worker:
    rank = 0

    def __init__(self, log: list[str], polls_to_end: int) -> None:
        self.log, self.polls_to_end, self.launched = log, polls_to_end, 0

    def launch(self, scheduler_output) -> _Step:
        self.log.append(f"launch {self.launched}")
        step = _Step(self.launched, self.log, self.polls_to_end)
        self.launched += 1
        return step


class _Inputs:
    """Messages that become visible after a number of empty polls each (the wire's delay)."""

    def __init__(self, messages: list[tuple[int, bytes]]) -> None:
        self.messages = messages
        self.empty_polls = 0

    def poll(self, timeout: int) -> bool:
        if not self.messages:
            raise AssertionError("the rank waited for a message that never comes")
        delay, _ = self.messages[0]
        if self.empty_polls >= delay:
            return True
        self.empty_polls += 1
        return False

    def recv(self) -> bytes:
        self.empty_polls = 0
        return self.messages.pop(0)[1]


class _Outputs:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def send(self, message: bytes) -> None:
        self.log.append("send")


def _step_message() -> bytes:
    empty = StepMessage(
        new_requests=[],
        scheduled=[],
        total_num_scheduled_tokens=0,
        finished_req_ids=[],
        preempted_req_ids=[],
    )
    return encode("step", msgspec.Raw(msgspec.msgpack.encode(empty)))


def _run(message_delay: int, polls_to_end: int) -> list[str]:
    log: list[str] = []
    messages = [(0, _step_message()), (message_delay, _step_message())]
    messages.append((10_000 if message_delay < polls_to_end else 0, encode("shutdown", None)))
    loop = RankLoop(_Worker(log, polls_to_end), _Inputs(messages), _Outputs(log))
    loop.run()
    return log


def test_the_next_step_is_launched_before_the_running_one_is_collected():
    # Step 1's message comes after 3 polls; step 0 runs for 50: it is launched behind step 0.
    log = _run(message_delay=3, polls_to_end=50)
    assert log[:4] == ["launch 0", "launch 1", "collect 0", "send"]


def test_a_step_that_ends_first_is_sent_at_once():
    # Step 0 ends after 2 polls; step 1's message would come after 40: step 0's tokens go first.
    log = _run(message_delay=40, polls_to_end=2)
    assert log[:4] == ["launch 0", "collect 0", "send", "launch 1"]
