"""The operator's plugin lists (LAYER_BOUNDARY_PLUGINS, LAYER_BOUNDARY_DISABLE): a list that names
nothing, or a name twice, is said rather than taken silently."""

from __future__ import annotations

import logging

from layer_boundary._plugins import PluginStatus, discover
from plugin_fixtures import PluginSite, plugin_site  # noqa: F401  (fixture)


def test_an_allow_list_that_names_no_plugin_says_that_nothing_loads(plugin_site: PluginSite, caplog, monkeypatch):
    # A trial: LAYER_BOUNDARY_PLUGINS="," loaded no plugin, without a word.
    plugin_site.add("acme")
    monkeypatch.setenv("LAYER_BOUNDARY_PLUGINS", ",")
    with caplog.at_level(logging.WARNING, logger="layer_boundary.plugins"):
        reg = discover()
    assert "LAYER_BOUNDARY_PLUGINS=',' names no plugin: no plugin is loaded (unset it to load every installed " \
           "plugin)" in caplog.text
    assert all(r.status is not PluginStatus.ACTIVE for r in plugin_site.mine(reg.records))


def test_a_name_given_twice_is_said_and_taken_once(plugin_site: PluginSite, caplog, monkeypatch):
    plugin_site.add("acme")
    monkeypatch.setenv("LAYER_BOUNDARY_PLUGINS", "acme,acme")
    with caplog.at_level(logging.WARNING, logger="layer_boundary.plugins"):
        reg = discover()
    assert "LAYER_BOUNDARY_PLUGINS names 'acme' more than once; each is taken once" in caplog.text
    assert [r.status for r in plugin_site.mine(reg.records)] == [PluginStatus.ACTIVE]


def test_plugins_check_of_a_name_in_another_case_says_the_installed_name(plugin_site: PluginSite, capsys):
    from layer_boundary._cli.main import main

    plugin_site.add("acme")
    assert main(["plugins", "--check", "Acme"]) == 1
    assert "layer-boundary plugins --check: Acme is not active (not installed; names are case-sensitive: 'acme')" \
        in capsys.readouterr().err


def test_a_slow_manifest_import_is_said(plugin_site: PluginSite, caplog, monkeypatch):
    # A trial: a manifest that imported torch and slept 2 s was listed active without a word, though
    # discovery imports every installed plugin's manifest at every startup.
    from layer_boundary._plugins import discovery

    monkeypatch.setattr(discovery, "MANIFEST_SLOW_S", 0.05)
    mod, hooks = plugin_site.module_names("sloth")
    plugin_site.add("sloth", manifest_source=f"""
        import time
        time.sleep(0.1)
        from layer_boundary.plugin_api import PluginManifest
        MANIFEST = PluginManifest(name="sloth", api_version=1, provides=("norm_kernels",), hooks={hooks!r})
        """)
    with caplog.at_level(logging.WARNING, logger="layer_boundary.plugins"):
        reg = discover()
    assert [r.status for r in plugin_site.mine(reg.records)] == [PluginStatus.ACTIVE]
    assert f"plugin sloth: importing its manifest ({mod}:MANIFEST) took" in caplog.text
    assert "keep the manifest module light" in caplog.text
