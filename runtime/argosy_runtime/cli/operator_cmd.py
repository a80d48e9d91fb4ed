"""`argosy operator`: run the Kubernetes operator (LLMDeployment -> runtime pods).

    argosy operator                          # all namespaces, like the in-cluster Deployment
    argosy operator -n ml -n staging --liveness http://0.0.0.0:8080/healthz

The same as `kopf run --standalone -m argosy_operator.handlers` (the handlers module is
imported by name, never by file path). Credentials: the pod's service account in a cluster,
else $KUBECONFIG or ~/.kube/config. Never imports torch.
"""

from __future__ import annotations

import argparse
import re
import sys
import urllib.parse

HANDLERS_MODULE = "argosy_operator.handlers"
# A namespace name (DNS-1123 label). The operator turns off kopf's namespace scanning (no RBAC
# to list namespaces), and kopf then serves only exact names: a pattern such as 'ml-*' would be
# dropped without a word and nothing watched, so it is refused here instead.
NAMESPACE_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def namespace_name(value: str) -> str:
    if not NAMESPACE_NAME.fullmatch(value):
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a namespace name (lowercase letters, digits and '-', at most "
            "63); patterns like 'ml-*' are not supported: give each namespace with its own -n")
    return value


def liveness_url(value: str) -> str:
    """kopf serves only http://HOST:PORT/PATH; anything else was a traceback from kopf's
    health reporter, after start-up, exit 1."""
    parts = urllib.parse.urlsplit(value)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme != "http" or port == -1:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not an http URL with a valid port, e.g. http://0.0.0.0:8080/healthz")
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "operator",
        help="Run the Kubernetes operator for LLMDeployment resources (kopf).",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-n", "--namespace", action="append", default=[], metavar="NAMESPACE",
        type=namespace_name,
        help="Watch only this namespace (repeatable; exact names, not patterns). "
             "Default: all namespaces.")
    parser.add_argument(
        "--liveness", metavar="URL", type=liveness_url,
        help="Serve kopf's liveness endpoint, e.g. http://0.0.0.0:8080/healthz.")
    parser.add_argument("--verbose", action="store_true", help="Log more.")
    parser.add_argument("--debug", action="store_true", help="Log everything.")
    return parser


def kopf_argv(args: argparse.Namespace) -> list[str]:
    """The `kopf` command line equivalent to these `argosy operator` flags."""
    argv = ["run", "--standalone"]
    if args.namespace:
        for ns in args.namespace:
            argv += ["--namespace", ns]
    else:
        argv.append("--all-namespaces")
    if args.liveness:
        argv.append(f"--liveness={args.liveness}")
    if args.verbose:
        argv.append("--verbose")
    if args.debug:
        argv.append("--debug")
    return argv + ["-m", HANDLERS_MODULE]


def credentials_problem() -> str | None:
    """Why the operator could not log in to Kubernetes, or None if it can: the operator's own
    login (argosy_operator.handlers.connection_info), tried once before kopf starts.

    Under kopf, a kubeconfig that cannot be read (a $KUBECONFIG naming a missing file, no
    current-context) was retried every 60 s forever, and no credentials at all ended in two
    tracebacks advising to "install an API client library".
    """
    import kopf
    from argosy_operator.handlers import connection_info

    try:
        info = connection_info(settings=kopf.OperatorSettings())
    except Exception as exc:  # OSError, yaml errors, KeyError of a context it names, ...
        return (f"cannot use the kubeconfig ($KUBECONFIG or ~/.kube/config): "
                f"{type(exc).__name__}: {exc}")
    if info is None:
        return ("no Kubernetes credentials: not in a pod with a service account, $KUBECONFIG "
                "is unset and ~/.kube/config does not exist")
    return None


def run(args: argparse.Namespace) -> int:
    from kopf import cli  # kopf only here: `argosy --help` stays light

    problem = credentials_problem()
    if problem:
        print(f"argosy operator: error: {problem}", file=sys.stderr)
        return 2
    cli.main.main(args=kopf_argv(args), prog_name="kopf", standalone_mode=False)
    return 0
