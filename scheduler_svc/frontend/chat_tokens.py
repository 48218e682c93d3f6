"""A rendered chat as tokens, with the client's text kept out of the control tokens: a user who
writes "<|im_start|>system" (or "<think>", "<tool_call>": every added token) in a message gets
those characters tokenized as text, never the template's turn marker, so no client can write
template structure (a fake system turn, a fake reasoning block or tool call) into a prompt. The
same holds for every string a client supplies (contents, reasoning, tool calls and results, tools).

How: before rendering, each control token's text inside the client's strings gets a marker
character inserted (one that none of the strings holds); the template renders those strings as
usual; afterwards the marked occurrences are the client's, every other control token text is the
template's. The rendered text (markers removed) is then split at the template's control tokens,
which become their ids, and the pieces between them are tokenized with control tokens read as
text. The tokenizer splits its input at added tokens before anything else, so a chat whose text
holds no control token gets exactly the ids of tokenizing the rendered text as a whole.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from scheduler_svc.frontend.tokenizer import Tokenizer

# Private-use characters tried as the marker, in order: the first that no client string holds.
_MARKERS = (chr(c) for c in range(0xE000, 0xF900))


@dataclass(frozen=True, slots=True)
class Escaper:
    """Inserts `marker` after the first character of each control token's text."""
    marker: str
    specials: tuple[str, ...]

    def escape(self, text: str, keep: tuple[str, ...] = ()) -> str:
        """`text` with each control token's text marked, but those in `keep`."""
        for special in self.specials:
            if special in text and special not in keep:
                text = text.replace(special, special[0] + self.marker + special[1:])
        return text


def escaper_for(tokenizer: Tokenizer, strings: Iterable[str]) -> Escaper | None:
    """An Escaper when any of `strings` holds a control token's text, else None (nothing to do)."""
    specials = tuple(sorted(tokenizer.control_tokens, key=len, reverse=True))
    strings = [s for s in strings if s]
    if not any(special in s for s in strings for special in specials):
        return None
    marker = next(m for m in _MARKERS if not any(m in s for s in strings))
    return Escaper(marker, specials)


def tokenize_rendered(tokenizer: Tokenizer, rendered: str, escaper: Escaper | None,
                      encode: Callable[[str], list[int]]) -> tuple[str, list[int]]:
    """(the rendered text without markers, its token ids). `encode` tokenizes a text with no
    client-written special token in it (the plain case)."""
    if escaper is None:
        return rendered, encode(rendered)
    pattern = "|".join(re.escape(s[0] + escaper.marker + s[1:]) + "|" + re.escape(s) for s in escaper.specials)
    ids: list[int] = []
    text_parts: list[str] = []
    pending = []                        # text since the last template special token
    for piece in re.split(f"({pattern})", rendered):
        if not piece:
            continue
        special_id = tokenizer.control_tokens.get(piece)
        if special_id is not None:      # unmarked: the template's own
            ids += tokenizer.encode_plain("".join(pending))
            pending = []
            ids.append(special_id)
            text_parts.append(piece)
            continue
        plain = piece.replace(escaper.marker, "")
        pending.append(plain)
        text_parts.append(plain)
    ids += tokenizer.encode_plain("".join(pending))
    return "".join(text_parts), ids
