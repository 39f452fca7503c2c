"""The device count in a resume command (flexpar/core/resume_words.py)."""

import shlex

from hypothesis import given
from hypothesis import strategies as st

from flexpar.core import resume_words

FLAGS = st.lists(st.sampled_from(["--steps", "9", "--port", "29500", "--oversubscribe"]), max_size=4)
SCRIPT_ARGS = st.lists(st.sampled_from(["--devices", "1", "--devices=3", "--lr", "0.1"]), max_size=5)


@given(FLAGS, SCRIPT_ARGS, st.integers(min_value=0, max_value=8), st.booleans())
def test_the_count_goes_into_flexpars_flags_and_the_scripts_arguments_stay(flags, script_args, count, always):
    words = ["flexpar", "run", "--resume", "--checkpoint-dir", "/ck", *flags, "/s/t.py"]
    words += ["--", *script_args] if script_args else []
    command = shlex.join(words)
    result = shlex.split(resume_words.with_device_count(command, count, always))
    script = resume_words.script_position(result)
    assert result[script:] == words[len(words) - len(result[script:]) :], "the script and its arguments stay"
    wanted = count >= 1 and (always or resume_words.names_a_count(script_args))
    if wanted:
        assert result[:script] == words[:3] + ["--devices", str(count)] + words[3 : words.index("/s/t.py")]
    else:
        assert result == words


def test_flexpars_own_count_is_kept():
    command = "flexpar run --resume --devices 3 --checkpoint-dir /ck SCRIPT"
    assert resume_words.with_device_count(command, 2, always=True) == command
    assert resume_words.local_count(["local-0", "node2-0", "local-1"]) == 2
