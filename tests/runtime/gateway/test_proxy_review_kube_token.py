"""Review of Kubernetes discovery's credentials (backends/kube_api.py): a service-account
token that kubelet rotates in place is read again, not kept from start-up."""

from __future__ import annotations

from pathlib import Path

import pytest
from argosy_runtime.gateway.backends import kube_api


def test_an_in_cluster_token_rotated_by_kubelet_is_used(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "token").write_text("token-1\n")
    (tmp_path / "ca.crt").write_text("")
    monkeypatch.setattr(kube_api, "SERVICE_ACCOUNT", tmp_path)
    monkeypatch.setattr(kube_api.ssl, "create_default_context", lambda cafile=None: None)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    api = kube_api.resolve()
    assert api.base_url == "https://10.0.0.1:443"
    assert api.headers == {"Authorization": "Bearer token-1"}
    # kubelet writes the refreshed token (the old one expires): the next request carries it.
    (tmp_path / "token").write_text("token-2\n")
    assert api.headers == {"Authorization": "Bearer token-2"}
    # A read that finds nothing (mid-swap) keeps the last token rather than sending none.
    (tmp_path / "token").unlink()
    assert api.headers == {"Authorization": "Bearer token-2"}


def test_a_kubeconfig_token_file_is_read_again(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("token-1")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\n"
        "clusters: [{name: c, cluster: {server: 'http://127.0.0.1:1'}}]\n"
        f"users: [{{name: u, user: {{tokenFile: '{token}'}}}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\ncurrent-context: c\n")
    api = kube_api.from_kubeconfig(kubeconfig)
    assert api.headers == {"Authorization": "Bearer token-1"}
    token.write_text("token-2")
    assert api.headers == {"Authorization": "Bearer token-2"}
