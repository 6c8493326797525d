"""The JupyterLab settings kvlab ships (jupyter/overrides.json, which ``make install`` copies to
``<venv>/share/jupyter/lab/settings/overrides.json``) against the installed JupyterLab's own schemas.

JupyterLab applies an override whose plugin id or key it does not know silently (nothing happens), so
every plugin id must name an installed schema, every key one of its properties, and every value must
validate against that property. The behaviour it is there for: ``make lab`` opens with no "Would you
like to get notified about official Jupyter news?" prompt and fetches no news (the prompt shows while
``fetchNews`` is ``"none"``; ``"false"`` is "Never"). The browser test (test_lab_browser.py) checks the
page itself.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
OVERRIDES = json.loads((REPO / "jupyter" / "overrides.json").read_text())


def _schemas_dir() -> Path:
    try:
        from jupyterlab.commands import get_app_dir
    except ImportError as e:  # fail, don't skip: `make install` installs it
        pytest.fail(f"{e.name} is missing: `pip install -e .[dev,notebooks]` (make install does)")
    return Path(get_app_dir()) / "schemas"


def _schema(plugin_id: str) -> dict:
    package, plugin = plugin_id.split(":")
    path = _schemas_dir() / package / f"{plugin}.json"
    assert path.is_file(), f"jupyter/overrides.json: {plugin_id!r} is no installed JupyterLab plugin ({path} missing)"
    return json.loads(path.read_text())


@pytest.mark.parametrize("plugin_id", sorted(OVERRIDES))
def test_every_override_names_a_real_setting_with_a_valid_value(plugin_id):
    import jsonschema

    props = _schema(plugin_id)["properties"]
    for key, value in OVERRIDES[plugin_id].items():
        assert key in props, f"{plugin_id}: no setting {key!r}; it has {sorted(props)}"
        jsonschema.validate(value, props[key])


def test_news_are_never_fetched_and_never_asked_about():
    schema = _schema("@jupyterlab/apputils-extension:notification")["properties"]
    notif = OVERRIDES["@jupyterlab/apputils-extension:notification"]
    never = next(o["const"] for o in schema["fetchNews"]["oneOf"] if o["title"] == "Never")
    assert notif["fetchNews"] == never == "false"          # "none" (the default) is the prompt
    assert notif["checkForUpdates"] is False


def test_the_makefile_installs_this_file():
    make = (REPO / "Makefile").read_text()
    assert "LAB_OVERRIDES := $(VENV)/share/jupyter/lab/settings/overrides.json" in make
    assert "cp jupyter/overrides.json $@" in make
