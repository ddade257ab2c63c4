"""`make test`'s workers get whole files, and the e2e files (one shared `llm-mesh up`) together."""

from __future__ import annotations

from tests.support.scheduling import work_unit


def test_tests_of_one_file_are_one_unit_and_files_are_apart() -> None:
    a = work_unit("tests/integration/test_gateway.py::test_complete_answers_as_json")
    b = work_unit("tests/integration/test_gateway.py::test_sigterm_lets_a_stream_in_flight_finish")
    c = work_unit("tests/unit/router/test_ring.py::Ring::test_spread[3]")
    assert a == b == "tests/integration/test_gateway.py"
    assert c == "tests/unit/router/test_ring.py"


def test_every_e2e_file_is_in_the_same_unit() -> None:
    units = {
        work_unit("tests/e2e/test_up.py::test_ready_block_lists_every_service_and_its_own_redis"),
        work_unit("tests/e2e/test_chat_pty.py::test_ctrl_c_interrupts_the_answer_and_the_prompt_returns"),
        work_unit("tests/e2e/test_observability.py::test_cache_lookup_has_its_own_span_in_the_trace"),
    }
    assert len(units) == 1
    assert work_unit("tests/e2e_extra/test_x.py::t") == "tests/e2e_extra/test_x.py"
