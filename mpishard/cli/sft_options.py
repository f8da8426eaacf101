"""The train command's fine-tune options: records, examples, `--pack` and `--loss-on`.

    train --init-from-hf ./llama --dataset jsonl:chat.jsonl --pack        # encoded in memory
    mpishard tokenize --tokenizer ./llama --dataset 'jsonl:chat/*.jsonl' --out chat-tok
    train --init-from-hf ./llama --dataset tokens:chat-tok --pack         # memory-mapped

`--dataset jsonl:FILE|GLOB`, `parquet:FILE|GLOB` or `hfdisk:DIR`: fine-tune records
(train/records.py, the `sft` extra) encoded in memory on every rank with the run's tokenizer
(--tokenizer, else the --init-from-hf directory's, else bytes) into examples with a loss mask
(train/examples.py): plain text (`--text-field`), prompt/completion pairs or chat `messages`
(rendered with `--chat-template FILE`, else the tokenizer's own template; a given template
travels with the tokenizer into the checkpoints, as its chat_template.jinja). The last
--val-fraction of the examples is the validation split (> 0). `--dataset tokens:DIR` of a version-2
directory (`tokenize --dataset ...`) holds the same examples on disk, read a row at a time.

The examples become rows of seq_len + 1 tokens (train/sft_rows.py): one example per row,
padded, or with `--pack` several whole examples per row, attention kept inside each. The loss
counts the completion or assistant tokens (`--loss-on completion`, the default: the mask the
tokenizing made; every token of a plain-text record) or every real token (`--loss-on all`);
never padding, nor an example's last token; an example longer than a row is cut to it
(the start-up log counts them per split). A record that lacks its fields or has the wrong
types stops the run with one line naming its file and line, on every rank (train's
`prepare_training` is agreed on every rank).
"""
from __future__ import annotations

from ..train.example_tokens import read_examples
from ..train.examples import encode_records, open_with_template
from ..train.records import is_records_name
from ..train.sft_rows import LOSS_ON, example_dataset
from ..train.text import DEFAULT_VAL_FRACTION
from ..train.tokens import EXAMPLES_VERSION, is_tokens_name, read_header, tokens_directory
from .usage import UsageError, refuse_flags

SFT_DEFAULTS = {"text_field": None, "chat_template": None, "pack": None, "loss_on": None}
RECORDS = "--dataset jsonl:|parquet:|hfdisk:"
RECORDS_ONLY = {"text_field": "--text-field", "chat_template": "--chat-template"}
ROWS_ONLY = {"pack": "--pack", "loss_on": "--loss-on"}
NOT_WITH_RECORDS = {"corpus": "--text", "corpus_bytes": "--corpus-bytes",
                    "train_stride": "--train-stride"}


def add_sft_arguments(data_group):
    """--text-field, --chat-template, --pack and --loss-on on the data group (its recording
    add_argument)."""
    data_group("--text-field", metavar="NAME", help=f"{RECORDS}: the field of plain-text "
               "records (default text; otherwise the kind comes from the first record: "
               "messages, prompt/completion or text)")
    data_group("--chat-template", metavar="FILE", help=f"{RECORDS} of chat messages: the "
               "jinja chat template (.jinja, or a .json with a chat_template key) instead of "
               "the tokenizer's")
    data_group("--pack", action="store_true", default=None, help="fine-tune examples: pack "
               "several whole examples into each row, attention kept inside each (default: "
               "one example per row, padded)")
    data_group("--loss-on", choices=LOSS_ON, help="fine-tune examples: the tokens the loss "
               "counts: completion (default: the answers, assistant turns, every token of "
               "plain text) or all (every real token)")


def validate_sft_args(args) -> bool:
    """Whether --dataset names records; UsageError (no MPI, the same on every rank) for a
    fine-tune flag where it does not apply."""
    records = is_records_name(args.dataset)
    if not records:
        refuse_flags(args, RECORDS_ONLY, f"{RECORDS} (tokenize takes it for tokens:DIR)")
        if not is_tokens_name(args.dataset):
            refuse_flags(args, ROWS_ONLY, f"fine-tune examples: {RECORDS} or tokens:DIR "
                         f"made by `tokenize --dataset`")
    else:
        refuse_flags(args, NOT_WITH_RECORDS, f"--dataset text; {args.dataset} holds records")
    return records


def check_val_fraction(args) -> None:
    """UsageError for --val-fraction 0 (or below): the validation split needs one example
    (of records) or one window (of text), so a split of none is refused, not taken as the
    default."""
    if args.val_fraction is not None and args.val_fraction <= 0:
        raise UsageError(f"--val-fraction must be > 0, got {args.val_fraction:g}: the "
                         f"validation split needs at least one example (or window); leave "
                         f"it out for the default {DEFAULT_VAL_FRACTION}")


def examples_dataset(args, tokenizer, seq_len: int):
    """The ExampleDataset (rows of seq_len) of --dataset records, encoded by `tokenizer`
    (its `tokenizer`: that one, carrying a --chat-template), or of tokens:DIR of version 2;
    None for a version-1 tokens:DIR (windows of flat tokens, refusing --pack and --loss-on).
    ValueError for a bad record or directory."""
    pack, loss_on = bool(args.pack), args.loss_on or LOSS_ON[0]
    if is_tokens_name(args.dataset):
        directory = tokens_directory(args.dataset)
        if read_header(directory)["version"] != EXAMPLES_VERSION:
            refuse_flags(args, ROWS_ONLY, f"examples; {args.dataset} holds flat tokens "
                         f"(`tokenize --text`), `tokenize --dataset` writes examples")
            return None
        refuse_flags(args, {"train_stride": "--train-stride"}, f"windows of flat tokens; "
                     f"{args.dataset} holds examples")
        splits, header = read_examples(directory)
        info = dict(header["corpus"], tokenizer=header["tokenizer"], eos_id=header["eos_id"],
                    records=header["records"], dtype=header["dtype"])
        vocab = int(header["vocab_size"])
    else:
        records, template = open_with_template(args.dataset, args.text_field,
                                               args.chat_template)
        if template is not None:        # the checkpoints carry the template rendered with
            tokenizer = tokenizer.with_chat_template(template)
        fraction = DEFAULT_VAL_FRACTION if args.val_fraction is None else args.val_fraction
        splits, encoded = encode_records(records, tokenizer, chat_template=template,
                                         val_fraction=fraction,
                                         require_counted=loss_on == LOSS_ON[0])
        info = dict(encoded["corpus"], tokenizer=encoded["tokenizer"],
                    eos_id=encoded["eos_id"], records=encoded["records"])
        vocab = int(tokenizer.vocab_size)
    info.update(pack=pack, loss_on=loss_on,
                **{f"{k}_examples": len(v) for k, v in splits.items()})
    data = example_dataset(args.dataset, splits, seq_len, vocab, info, pack, loss_on)
    data.tokenizer = tokenizer          # records: the one that encoded them (None: tokens:)
    return data


def log_examples(log, data) -> None:
    """One line on fine-tune examples: the records, the tokenizer, the examples and rows,
    and how many examples of each split were cut to a row."""
    c = data.corpus
    r, t = c["records"], c["tokenizer"]
    log.info("records %s: %d %s record(s), sha256 %s; tokenizer %s (vocab %d, eos %s); %d "
             "train + %d validation examples in %d + %d %s rows of %d tokens; %d train + %d "
             "validation examples longer than seq_len + 1 tokens cut to it%s", r["source"],
             r["count"], r["kind"], str(r["sha256"])[:16], t["name"], data.n_classes,
             c["eos_id"], c["train_examples"], c["val_examples"], c["train_rows"],
             c["val_rows"], "packed" if data.pack else "padded", data.seq_len,
             c["train_truncated"], c["val_truncated"],
             " (their tokens past the cut count nowhere; a longer --seq-len keeps them)"
             if c["train_truncated"] or c["val_truncated"] else "")


__all__ = ["SFT_DEFAULTS", "add_sft_arguments", "check_val_fraction", "examples_dataset",
           "log_examples", "validate_sft_args"]
