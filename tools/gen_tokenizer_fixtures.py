#!/usr/bin/env python3
"""Independent oracles for the tokenizer and chat tests (run by hand; `cargo test` only
reads what this writes).

1. tests/fixtures/tokenizer/tiktoken_cases.json: ids from Python `tiktoken.Encoding`
   built the way `tokenization_kimi.py` (moonshotai Kimi K3 / Kimi Linear) builds it:
   ranks from tiktoken.model, its `pat_str`, and a special map naming every id in
   [n_base, n_base + 256) from `added_tokens_decoder` (else `<|reserved_token_{id}|>`),
   with its 400k-char / 25k-run input splitting. The vocabulary is the synthetic one in
   tests/fixtures/tokenizer/synthetic/ (written by `write_synthetic_tokenizer`, checked
   by tests/text/tokenizer.rs); the real Kimi tiktoken.model is not available offline.
2. tests/fixtures/tokenizer/chat_cases.json: tools/templates/Kimi-K3.jinja rendered by
   Python jinja2 the way Hugging Face `apply_chat_template` sets jinja2 up.

Usage:
    pip install tiktoken jinja2
    python3 tools/gen_tokenizer_fixtures.py
"""

import json
import os

import jinja2
import jinja2.ext
import tiktoken
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tiktoken.load import load_tiktoken_bpe

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "tokenizer")
VOCAB_DIR = os.path.join(FIXTURES, "synthetic")

# Verbatim from TikTokenTokenizer.pat_str in tokenization_kimi.py.
PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
NUM_RESERVED_SPECIAL_TOKENS = 256
TIKTOKEN_MAX_ENCODE_CHARS = 400_000
MAX_NO_WHITESPACES_CHARS = 25_000


def split_whitespaces_or_nonwhitespaces(s, max_len):
    """Copy of TikTokenTokenizer._split_whitespaces_or_nonwhitespaces."""
    current_slice_len = 0
    current_slice_is_space = s[0].isspace() if len(s) > 0 else False
    slice_start = 0
    for i in range(len(s)):
        is_now_space = s[i].isspace()
        if current_slice_is_space ^ is_now_space:
            current_slice_len = 1
            current_slice_is_space = is_now_space
        else:
            current_slice_len += 1
            if current_slice_len > max_len:
                yield s[slice_start:i]
                slice_start = i
                current_slice_len = 1
    yield s[slice_start:]


def kimi_encode(enc, text, allow_special):
    """TikTokenTokenizer.encode without kwargs."""
    out = []
    for i in range(0, len(text), TIKTOKEN_MAX_ENCODE_CHARS):
        for sub in split_whitespaces_or_nonwhitespaces(
            text[i : i + TIKTOKEN_MAX_ENCODE_CHARS], MAX_NO_WHITESPACES_CHARS
        ):
            if allow_special:
                out.extend(enc.encode(sub, allowed_special="all"))
            else:
                out.extend(enc.encode(sub, disallowed_special=()))
    return out


def build_encoding():
    ranks = load_tiktoken_bpe(os.path.join(VOCAB_DIR, "tiktoken.model"))
    n_base = len(ranks)
    with open(os.path.join(VOCAB_DIR, "tokenizer_config.json"), encoding="utf-8") as f:
        added = json.load(f)["added_tokens_decoder"]
    names = {int(k): v["content"] for k, v in added.items()}
    end = max([n_base + NUM_RESERVED_SPECIAL_TOKENS] + [k + 1 for k in names])
    specials = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(n_base, end)}
    return tiktoken.Encoding(
        name="synthetic", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=specials
    )


ORDINARY = [
    "",
    "x",
    " ",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'll say don't, can't, WE'RE, they've, she'd, it's, I'M, you'LL.",
    "In 2024 there were 123456 events, or 3.14159 pi; 1,000,000 and 0.0001 and 99999999999.",
    "def foo(x: int) -> bool:\n    return x > 0  # comment\n\n\nclass A:\n\tpass\n",
    'fn main() { let v: Vec<u8> = vec![1, 2, 3]; println!("{v:?}"); }',
    "if (a && b || !c) { x += 1; } else { y -= 2; } // <=> => -> :: ... ;;",
    "你好世界，欢迎使用Kimi！中文与English混合的text。",
    "こんにちは、世界。カタカナとひらがな",
    "한국어 문장입니다. Ελληνικά κείμενα. Русский текст. العربية. हिन्दी पाठ",
    "café naïve résumé Zürich São Paulo Ångström",
    "e\u0301 combining marks: a\u0300\u0301\u0302 and Hangul jamo \u1100\u1161",
    "🎉🚀 emoji test 😀 family 👨‍👩‍👧‍👦 flags 🇯🇵🇫🇷 skin 👍🏽 keycap 1️⃣",
    "tabs\tand\u00a0nbsp\u2003em space\u3000ideographic\u2028line sep\u2029para",
    "end   ",
    "   leading spaces",
    "a  b\n\n\nc\r\n\r\nd \n \n e",
    " " * 40 + "x" + "\n" * 12 + "y" + "\t" * 7,
    "separators \x1c\x1d\x1e\x1f and controls \x00\x01\x07\x7f",
    "replacement \ufffd and BOM \ufeff and zero width \u200b\u200c\u200d",
    "looks special: <|open|>think<|sep|> [BOS] <|end_of_msg|> <|reserved_token_900|>",
    "<|open|<|sep||>>><|",
    "'s 're 've 'm 'll 'd 'S 'RE",
    "mixed中文123and456漢字789",
    "URL https://example.com/path?query=1&b=two#frag and email someone@example.org",
    "Math: ∑_{i=1}^{n} i² = n(n+1)/2, ∫ f(x) dx ≈ 0.5, α β γ δ ∞ ≠ ≤ ≥",
    "\U0001d400\U0001d401 math bold, \U00020000 CJK ext B, \U0010fffd private",
]

LONG = [
    # Runs longer than the 25k cut change where pieces start.
    "a" + " " * 30_000 + "b",
    "x" * 60_000,
    ("word " * 6_000) + "\n" * 26_000 + "tail",
]

WITH_SPECIAL = [
    "<|open|>message role=\"user\"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>",
    "[BOS]text[EOS] [PAD][UNK]",
    "<|open|>think<|sep|>hmm<|close|>think<|sep|><|open|>response<|sep|>ok",
    "partial <|open| and <|sep|> and <|reserved_token_1000|>",
]


def tokenizer_cases():
    enc = build_encoding()
    cases = []
    for text in ORDINARY:
        cases.append({"text": text, "special": False, "ids": kimi_encode(enc, text, False)})
    for text in WITH_SPECIAL:
        cases.append({"text": text, "special": True, "ids": kimi_encode(enc, text, True)})
        cases.append({"text": text, "special": False, "ids": kimi_encode(enc, text, False)})
    for text in LONG:
        cases.append({"text": text, "special": False, "ids": kimi_encode(enc, text, False)})
    return cases


def render(template, messages, add_generation_prompt, thinking, thinking_effort="default"):
    kwargs = {"messages": messages, "add_generation_prompt": add_generation_prompt}
    if thinking is not None:
        kwargs["thinking"] = thinking
    if thinking_effort != "default":
        kwargs["thinking_effort"] = thinking_effort
    return template.render(**kwargs)


CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue.", "reasoning": "Any color works; pick blue."},
        {"role": "user", "content": "Another?"},
    ],
    [
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "Again, with \"quotes\" & <tags> and\nnewlines\n"},
        {"role": "assistant", "content": "Hi again!", "reasoning": "   \n\t "},
        {"role": "user", "content": "中文 🎉"},
        {"role": "assistant", "content": "", "reasoning": "\n  keep my spaces  \n"},
        {"role": "user", "content": ""},
    ],
    [],
]


def chat_cases():
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    with open(os.path.join(HERE, "templates", "Kimi-K3.jinja"), encoding="utf-8") as f:
        template = env.from_string(f.read())
    cases = []
    for messages in CONVERSATIONS:
        for add_gen in (False, True):
            for thinking in (True, False):
                for effort in ("default", None, "low"):
                    if not thinking and effort != "default":
                        continue
                    cases.append(
                        {
                            "messages": messages,
                            "add_generation_prompt": add_gen,
                            "thinking": thinking,
                            "thinking_effort": effort,
                            "rendered": render(template, messages, add_gen, thinking, effort),
                        }
                    )
    return cases


def main():
    tok = tokenizer_cases()
    path = os.path.join(FIXTURES, "tiktoken_cases.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"tiktoken_version": tiktoken.__version__, "cases": tok}, f, ensure_ascii=False)
    print(f"wrote {len(tok)} cases -> {path}")
    chat = chat_cases()
    path = os.path.join(FIXTURES, "chat_cases.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"jinja2_version": jinja2.__version__, "cases": chat}, f, ensure_ascii=False, indent=1)
    print(f"wrote {len(chat)} cases -> {path}")


if __name__ == "__main__":
    main()
