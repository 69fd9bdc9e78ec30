"""Text of the OpenAI server: stop sequences over token deltas, and the Jinja chat template."""

from __future__ import annotations

import pytest

from edge.server.chat import ChatMessage, ChatTemplate, NoChatTemplate, load_chat_template, require
from edge.server.stop_text import StopText
from shared.errors import InvalidArgument

# token i decodes to PIECES[i]; 6 and 7 are the two halves of "é" as raw bytes
PIECES = ["ab", "c", "END", "x", "E", "ND", "\xc3", "\xa9"]


def decode(ids: list[int]) -> str:
    raw = "".join(PIECES[i] for i in ids).encode("latin-1")
    return raw.decode("utf-8", errors="replace")


def run(ids: list[int], stops: tuple[str, ...]) -> tuple[list[str], str, bool]:
    text = StopText(stops, decode)
    deltas = []
    for i in ids:
        deltas.append(text.add(i))
        if text.stopped:
            break
    deltas.append(text.flush())
    return deltas, text.final_text, text.stopped


def test_without_stops_every_token_is_handed_out_at_once() -> None:
    deltas, final, stopped = run([0, 1, 3], ())
    assert deltas == ["ab", "c", "x", ""] and final == "abcx" and not stopped


def test_a_stop_sequence_split_over_tokens_is_held_back_then_cut_away() -> None:
    deltas, final, stopped = run([0, 4, 5, 3], ("END",))
    assert deltas == ["ab", "", "", ""] and final == "ab" and stopped  # "E" waited; "ND" completed the stop


def test_held_back_text_that_does_not_become_a_stop_is_released() -> None:
    deltas, final, stopped = run([0, 4, 3], ("END",))
    assert deltas == ["ab", "", "Ex", ""] and final == "abEx" and not stopped


def test_the_earliest_of_several_stops_wins_and_text_after_it_in_the_same_token_is_dropped() -> None:
    deltas, final, stopped = run([1, 0, 2], ("b", "END"))
    assert deltas == ["c", "a", ""] and final == "ca" and stopped


def test_a_token_ending_inside_a_utf8_character_waits_for_the_next() -> None:
    deltas, final, _ = run([6, 7, 1], ())
    assert deltas == ["", "é", "c", ""] and final == "éc"


def test_held_back_text_is_flushed_at_the_end() -> None:
    deltas, final, stopped = run([0, 4], ("END",))
    assert deltas == ["ab", "", "E"] and final == "abE" and not stopped


TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


def test_the_chat_template_renders_messages_special_tokens_and_the_generation_prompt() -> None:
    t = ChatTemplate(TEMPLATE, {"bos_token": "<s>"})
    msgs = [ChatMessage("system", "be brief"), ChatMessage("user", "hi")]
    assert t.render(msgs) == "<s>[system] be brief\n[user] hi\n[assistant] "
    assert t.render(msgs, add_generation_prompt=False) == "<s>[system] be brief\n[user] hi\n"


def test_a_template_can_reject_a_conversation_with_a_bad_request() -> None:
    t = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok")
    assert t.render([ChatMessage("user", "x")]) == "ok"
    with pytest.raises(InvalidArgument, match="first must be user"):
        t.render([ChatMessage("assistant", "x")])


class _Tok:
    chat_template: str | None = None
    bos_token = "<s>"
    eos_token = "</s>"


def test_the_file_wins_over_the_tokenizer_template_and_without_either_chat_is_refused(tmp_path) -> None:
    tok = _Tok()
    assert load_chat_template(None, tok) is None
    with pytest.raises(NoChatTemplate, match="--chat-template FILE"):
        require(None)
    tok.chat_template = "T:{{ messages[0].content }}"
    own = load_chat_template(None, tok)
    assert own is not None and own.render([ChatMessage("user", "a")]) == "T:a"
    path = tmp_path / "t.jinja"
    path.write_text("F:{{ messages[0].content }}{{ eos_token }}")
    from_file = load_chat_template(path, tok)
    assert from_file is not None and from_file.render([ChatMessage("user", "a")]) == "F:a</s>"


def test_a_template_that_does_not_compile_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")
