"""The end-of-training table and the rates in the log lines: a slow run's rate is shown with
its digits (a GPT-2-small step on a few shared cores is a fraction of a sample a second)."""
from mpishard.train.summary import rate_text, summary_table


def test_rates_below_one_keep_three_digits_and_large_ones_are_whole():
    assert rate_text(0.3333) == "0.333"
    assert rate_text(12.345) == "12.3"
    assert rate_text(518.4) == "518"
    assert rate_text(12964.2) == "12964"


def test_the_table_shows_a_slow_runs_samples_and_tokens_per_second():
    metrics = dict(layout="dp=2,tp=2", world_size=4, model="gpt", dataset="tokens", steps=3,
                   epochs=0.16, final_loss=8.15, test_loss=7.68, test_accuracy=None,
                   samples_per_s=0.32, wall_time_s=75.0, val_bits_per_token=11.08,
                   tokens_per_s=40.96)
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip()
            for line in summary_table(metrics).splitlines() if line.startswith("|")}
    assert rows["samples/s"] == "0.32"
    assert rows["tokens/s"] == "41"
