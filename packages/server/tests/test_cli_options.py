"""``kvik serve``'s own options: refused before the engine loads, with a message naming the
option (each of these started the server, or failed after loading it with a traceback)."""

from __future__ import annotations

import pytest

from kvik_server.cli import main


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--port", "-1"], "--port must be in 0..65535"),
        (["--port", "99999"], "--port must be in 0..65535"),
        (["--api-key="], "--api-key must not be empty"),
        (["--served-model-name="], "--served-model-name must not be empty"),
        (["--max-body-bytes", "0"], "--max-body-bytes must be >= 1"),
        (["--shutdown-timeout", "-1"], "--shutdown-timeout must be >= 0"),
        # A mistyped file name would otherwise be the template: every chat prompt.
        (["--chat-template", "/no/such/template.jinja"], "neither a file nor a Jinja template"),
        (["--chat-template", "{% for %}"], "--chat-template does not parse"),
    ],
)
def test_bad_server_options_are_refused_before_loading(flags, message, capsys):
    # A model that does not exist: reaching the engine would fail differently.
    assert main(["/no/such/model", *flags]) == 2
    assert message in capsys.readouterr().err


def test_a_template_file_with_transformers_extensions_loads(tmp_path):
    """{% generation %} and loop controls are transformers' extensions to Jinja: templates use
    them, and the check must parse them as transformers does."""
    from kvik_server.cli import load_chat_template

    template = (
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}"
        "{% if loop.last %}{% break %}{% endif %}{% endfor %}"
    )
    path = tmp_path / "template.jinja"
    path.write_text(template)
    assert load_chat_template(str(path)) == template
    assert load_chat_template(template) == template
    assert load_chat_template(None) is None


def test_an_engine_configuration_error_is_one_line(capsys):
    """A mistyped model is found before the app starts (in its lifespan it was a traceback)."""
    assert main(["/no/such/model"]) == 2
    assert "kvik serve: model '/no/such/model' is neither a local folder" in capsys.readouterr().err
