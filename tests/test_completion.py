"""The client's Completion and CompletionDelta read how a request ended through the one FinalInfo record,
which crosses the sockets as it was made."""
from __future__ import annotations

from tandem.frontend.client.connection import decode_msg
from tandem.frontend.completion import Completion, to_delta
from tandem.protocol.codec import encode
from tandem.protocol.final_info import FinalInfo
from tandem.protocol.messages import OutputBatch, RequestOutput
from tandem.protocol.time_stats import TimeStats


def _final() -> FinalInfo:
    return FinalInfo("stop", "###", 5, 2, 3, 1, TimeStats(1.0, 1.5, 2.0, 3.0, [2.5]))


def test_completion_reads_the_final_record_it_was_given() -> None:
    comp = Completion("a")
    comp.add(RequestOutput("a", "he", [1]))
    assert (
        comp.final is None and comp.finish_reason is None and comp.metrics is None and comp.prompt_tokens == 0
    )
    final = _final()
    comp.add(RequestOutput("a", "y", [2], final))
    assert comp.text == "hey" and comp.token_ids == [1, 2] and comp.final is final
    got = (comp.finish_reason, comp.matched_stop, comp.prompt_tokens, comp.completion_tokens,
           comp.cached_tokens, comp.spec_accepted_tokens)
    assert got == ("stop", "###", 5, 2, 3, 1)
    assert comp.metrics is not None and comp.metrics.ttft_s == 1.0 and comp.metrics.e2e_s == 2.0


def test_a_streamed_delta_carries_the_same_record() -> None:
    assert not to_delta(RequestOutput("a", "he", [1])).finished
    final = _final()
    d = to_delta(RequestOutput("a", "y", [2], final))
    assert d.finished and d.final is final and d.finish_reason == "stop" and d.completion_tokens == 2


def test_the_record_crosses_a_socket_unchanged() -> None:
    msg = decode_msg(encode(OutputBatch([RequestOutput("a", "y", [2], _final())])))
    assert isinstance(msg, OutputBatch) and msg.outputs[0].final == _final() and msg.outputs[0].finished
