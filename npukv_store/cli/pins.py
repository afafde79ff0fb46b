"""``npukv pin`` and ``npukv unpin``: prompts whose blocks are never evicted
(docs/decisions/0067, docs/guide/tenants-and-pins.md).

Runs in: an operator's shell, beside live servers: a pin is one meta record
of the index, written in one transaction; servers read it within a second
and pin the keys of the first request that begins with the prompt.

    cmd_pin()   - record a pin: the digests of a prompt's tokens
    cmd_unpin() - remove pins by id, by label, or those expired
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from npukv_store.errors import NpuKVError
from npukv_store.keying import derive as derive_key
from npukv_store.keying import tenant_digest
from npukv_store.store.pins import (
    MAX_PIN_TOKENS,
    PIN_GRANULE,
    PinRecord,
    decode_pins,
    pin_digests,
)

_DURATION = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class PinUsageError(NpuKVError):
    """Arguments ``npukv pin`` cannot work with (exit 2)."""


def prompt_tokens(args: argparse.Namespace) -> list[int]:
    """The token ids to pin: a JSON list from --token-ids-file, or the text of
    --prompt-file through --model's tokenizer (special tokens as vLLM's
    completions API adds them, unless --no-special-tokens)."""
    if args.token_ids_file:
        try:
            ids = json.loads(Path(args.token_ids_file).read_text())
        except (OSError, ValueError) as exc:
            raise PinUsageError(
                f"--token-ids-file {args.token_ids_file}: {exc}; expected a JSON "
                "list of token ids"
            ) from None
        if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**31
            for i in ids
        ):
            raise PinUsageError(
                f"--token-ids-file {args.token_ids_file}: expected a JSON list of "
                "token ids (non-negative ints)"
            )
        return ids
    if not (args.prompt_file and args.model):
        raise PinUsageError(
            "expected --token-ids-file F, or --prompt-file F with --model M"
        )
    try:
        text = Path(args.prompt_file).read_text()
    except OSError as exc:
        raise PinUsageError(f"--prompt-file {args.prompt_file}: {exc}") from None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except Exception as exc:  # noqa: BLE001 - any loader failure: one line
        raise PinUsageError(
            f"--model {args.model}: cannot load its tokenizer ({exc}); expected "
            "the model path or name the servers run"
        ) from None
    return list(tokenizer.encode(text, add_special_tokens=not args.no_special_tokens))


def parse_duration(text: str | None) -> float | None:
    """``30m``, ``12h``, ``7d`` or seconds; None: never expires."""
    if text is None:
        return None
    unit = text[-1:].lower()
    number = text[:-1] if unit in _DURATION else text
    try:
        seconds = float(number) * _DURATION.get(unit, 1)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise PinUsageError(
            f"--ttl: found {text!r}, expected a duration such as 3600, 30m, 12h, 7d"
        )
    return seconds


def cmd_pin(args: argparse.Namespace, open_dir: Any) -> int:
    """``npukv pin`` (its help is :func:`npukv_store.cli.cmd_pin`'s)."""
    tokens = prompt_tokens(args)
    ttl = parse_duration(args.ttl)
    if len(tokens) < PIN_GRANULE or len(tokens) > MAX_PIN_TOKENS:
        raise PinUsageError(
            f"the prompt has {len(tokens)} tokens, expected {PIN_GRANULE} to "
            f"{MAX_PIN_TOKENS} (a pin covers whole blocks)"
        )
    cdir, index, _ = open_dir(args.cache_dir)
    try:
        secret = cdir.read_secret()
        digests = pin_digests(derive_key(secret, b"pin"), args.cache_salt, tokens)
        tenant = tenant_digest(derive_key(secret, b"tenant"), args.cache_salt)
        record = PinRecord.new(digests, tenant, label=args.label, ttl_s=ttl)
        index.add_pin(record.pin_id, record.to_json())
    finally:
        index.close()
    report = pin_summary(record)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        expires = "never" if ttl is None else f"in {args.ttl}"
        print(
            f"pinned {record.pin_id.hex()} ({args.label or 'no label'}): "
            f"{record.tokens} of {len(tokens)} tokens, tenant {tenant.hex()}, "
            f"expires {expires}"
        )
    return 0


def cmd_unpin(args: argparse.Namespace, open_dir: Any) -> int:
    """``npukv unpin`` (its help is :func:`npukv_store.cli.cmd_unpin`'s)."""
    if not (args.pin_ids or args.label or args.expired):
        raise PinUsageError("expected PIN_ID ..., --label L or --expired")
    _, index, _ = open_dir(args.cache_dir)
    removed = []
    try:
        now = time.time_ns()
        for pin_id, record in decode_pins(index.pin_records()).items():
            chosen = pin_id.hex() in args.pin_ids  # an unreadable one: by id only
            if isinstance(record, PinRecord):
                chosen |= bool(args.label) and record.label == args.label
                chosen |= args.expired and record.expired(now)
            if chosen and index.unpin(pin_id):
                removed.append(pin_id.hex())
    finally:
        index.close()
    missing = [p for p in args.pin_ids if p not in removed]
    for name in removed:
        print(f"unpinned {name}")
    if missing:
        raise PinUsageError(f"no pin {', '.join(missing)} in {args.cache_dir}")
    if not removed:
        print("no pin matched")
    return 0


def pin_summary(record: PinRecord) -> dict[str, Any]:
    return {
        "pin": record.pin_id.hex(),
        "label": record.label,
        "tenant": record.tenant.hex(),
        "tokens": record.tokens,
        "created_ns": record.created_ns,
        "expires_ns": record.expires_ns or None,
    }


def add_arguments(pin: argparse.ArgumentParser, unpin: argparse.ArgumentParser) -> None:
    source = pin.add_mutually_exclusive_group()
    source.add_argument("--prompt-file", metavar="F", help="the prompt's text")
    source.add_argument(
        "--token-ids-file", metavar="F",
        help="a JSON list of the prompt's token ids (exactly what servers see, "
        "e.g. after the chat template)",
    )  # fmt: skip
    pin.add_argument("--model", metavar="M", help="tokenizer of --prompt-file")
    pin.add_argument(
        "--no-special-tokens", action="store_true",
        help="tokenize without the BOS the completions API adds",
    )  # fmt: skip
    pin.add_argument(
        "--cache-salt", metavar="S", default=None,
        help="the requests' cache_salt (their tenant); default: none",
    )  # fmt: skip
    pin.add_argument("--ttl", metavar="T", help="expire after T (3600, 30m, 12h, 7d)")
    pin.add_argument("--label", default="", help="a name for npukv stats and unpin")
    pin.add_argument("--json", action="store_true", help="one JSON object")
    unpin.add_argument("pin_ids", nargs="*", metavar="PIN_ID", help="pin ids (hex)")
    unpin.add_argument("--label", default="", help="every pin with this label")
    unpin.add_argument("--expired", action="store_true", help="every expired pin")
