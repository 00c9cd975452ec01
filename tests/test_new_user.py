"""What a new user still tripped on (issue 68, item 6), each now one `error:` line (or a warning)
instead of a silent mistake or a traceback: a drafter trained for another method, `generate
--max-tokens`, `regen` of chat records on a target with no chat template, serve's `--body-timeout`."""

import json
import shutil

import pytest

from dmtp_jax.errors import InputError


def drafter_dir(path, dmtp_method=None):
    """A drafter directory's config alone (what preflight reads): DFlash, with a `dmtp_config` when
    `dmtp_method` is given."""
    path.mkdir()
    config = {"dflash_config": {"block_size": 4}}
    if dmtp_method:
        config["dmtp_config"] = {"method": dmtp_method, "rank": 0}
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_a_drafter_trained_for_another_method_is_refused_or_warned_about(tmp_path, capsys):
    from dmtp_jax.preflight import check_drafter_method
    plain, dmtp, adaptive = (drafter_dir(tmp_path / n, m) for n, m in
                             (("plain", None), ("dmtp", "dmtp"), ("adaptive", "dmtp-adaptive")))
    for methods, draft in ((["dflash", "ar"], plain), (["dmtp"], dmtp), (["dmtp-adaptive", "mtp"], adaptive)):
        check_drafter_method(methods, draft)                 # each drafter's own method: quiet
    assert capsys.readouterr().err == ""
    check_drafter_method(["dmtp"], plain)                    # a zero fusion: runs, warned
    check_drafter_method(["dflash"], dmtp)                   # the DFlash part of a DMTP drafter: runs, warned
    err = capsys.readouterr().err.splitlines()
    assert [line.split(";")[1].split("(")[1] for line in err] == ["use --method dflash)", "use --method dmtp)"]
    assert all(line.startswith("warning: ") for line in err)
    with pytest.raises(InputError, match="holds a 'dmtp-adaptive' drafter, not 'dmtp'") as e:
        check_drafter_method(["dmtp"], adaptive)             # its fusion would not load
    assert e.value.hint.startswith("use --method dmtp-adaptive")


def test_generate_max_tokens_suggests_max_new_tokens(capsys):
    import infer
    with pytest.raises(SystemExit) as stop:
        infer.main(["generate", "--max-tokens", "16"])
    err = capsys.readouterr().err.splitlines()
    assert stop.value.code == 2 and err == ["error: unrecognized arguments: --max-tokens 16",
                                            "hint: did you mean --max-new-tokens? (run 'infer.py generate --help' "
                                            "for the options)"]


def test_serve_body_timeout_flag(capsys):
    import infer
    from dmtp_jax.commands.inference import server_limits
    parser = infer.build_parser()
    assert server_limits(parser.parse_args(["serve", "--body-timeout", "2.5"])).body_timeout_s == 2.5
    with pytest.raises(InputError, match="--body-timeout"):
        server_limits(parser.parse_args(["serve", "--body-timeout", "0"]))


def test_regen_of_chat_records_without_a_chat_template_is_one_error_line(tiny_qwen3_dir, tmp_path, capsys):
    import train
    from dmtp_jax.tiny import save_byte_tokenizer
    target = tmp_path / "target"
    shutil.copytree(tiny_qwen3_dir, target)
    save_byte_tokenizer(str(target))                          # a tokenizer, no chat template
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    rc = train.main(["regen", "--target", str(target), "--data", str(data), "--out", str(tmp_path / "out.jsonl"),
                     "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert err.startswith("error: ") and "chat template" in err.splitlines()[0], err
