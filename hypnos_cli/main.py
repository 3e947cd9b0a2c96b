"""`hypnos <verb>`: the argument parser and the exit status (0 done, 1 the server refused or no
server answers, 2 a usage error, 130 interrupted)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from hypnos_cli.chat import do_run
from hypnos_cli.client import DEFAULT_URL, CliError, Server, cli_version
from hypnos_cli.commands import (
    do_batches,
    do_keys_create,
    do_keys_list,
    do_keys_revoke,
    do_list,
    do_load,
    do_logs,
    do_ps,
    do_status,
    do_unload,
)
from hypnos_cli.pull import do_pull

Handler = Callable[[Server, argparse.Namespace], int]
SubParsers = argparse._SubParsersAction  # argparse's own name for what add_subparsers returns
DESCRIPTION = """The operator's command line of a running Hypnos server (start one with ./run.sh).
It talks to the server over HTTP, as `ollama` does: --url (HYPNOS_URL, default http://127.0.0.1:9999)
and --key (HYPNOS_API_KEY, sent as a Bearer token) choose which server and as whom."""


def _global_options(defaults: bool) -> argparse.ArgumentParser:
    """--url, --key and --json, accepted before the verb and after it: the verb's copy has no
    default, so that it overrides the global one only when it is given."""
    options = argparse.ArgumentParser(add_help=False)
    unset = argparse.SUPPRESS
    options.add_argument(
        "--url", default=None if defaults else unset, help=f"the server (default: HYPNOS_URL, else {DEFAULT_URL})"
    )
    options.add_argument(
        "--key", default=None if defaults else unset, help="API key sent as a Bearer token (default: HYPNOS_API_KEY)"
    )
    options.add_argument(
        "--json", action="store_true", default=False if defaults else unset, help="print the server's JSON as it came"
    )
    return options


class Verbs:
    def __init__(self, parser: argparse.ArgumentParser, options: argparse.ArgumentParser):
        self.sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
        self.options = options

    def add(
        self, name: str, summary: str, handler: Handler, parent: SubParsers | None = None
    ) -> argparse.ArgumentParser:
        """A verb (of `parent`, for the verbs of `keys`) that takes the global options too."""
        verb = (parent or self.sub).add_parser(name, help=summary, description=summary, parents=[self.options])
        verb.set_defaults(handler=handler)
        return verb


def _model_verbs(verbs: Verbs) -> None:
    verbs.add("list", "the models in service: id, modality, tier, context, capabilities", do_list)
    ps = verbs.add("ps", "what is resident: the tiers' bytes, each model's placement and leases", do_ps)
    ps.add_argument("--all", action="store_true", help="tier 3 (disk) models too")
    pull = verbs.add("pull", "download a catalog variant into the server's models_dir, with progress", do_pull)
    pull.add_argument("name", metavar="ID[:QUANT]", help="a catalog id, its default variant or id:quant")
    load = verbs.add("load", "promote a model to tier 1 (GPU VRAM) and wait until it is there", do_load)
    load.add_argument("model")
    load.add_argument("--ctx", type=int, help="the context to allocate (default: the model's)")
    load.add_argument("--warm", action="store_true", help="only into tier 2 (host RAM), ready to promote")
    unload = verbs.add("unload", "demote a model to tier 2 (host RAM)", do_unload)
    unload.add_argument("model")
    unload.add_argument("--disk", action="store_true", help="to tier 3: free its host RAM too")
    run = verbs.add("run", "chat with a model in the terminal (or answer one prompt and exit)", do_run)
    run.add_argument("model")
    run.add_argument("prompt", nargs="*", help="answer this once and exit (else read turns from stdin)")
    run.add_argument("--system", help="a system message at the start of the conversation")
    run.add_argument("--temperature", type=float)
    run.add_argument("--max-tokens", type=int)
    run.add_argument("--seed", type=int)
    run.add_argument("--verbose", action="store_true", help="tokens and speed after each answer (stderr)")


def _server_verbs(verbs: Verbs) -> None:
    keys = verbs.add("keys", "the server's API keys (admin key needed)", _keys_usage)
    key_verbs = keys.add_subparsers(dest="keys_verb", metavar="create|list|revoke")
    create = verbs.add("create", "make a key; it is printed once, alone on stdout", do_keys_create, key_verbs)
    create.add_argument("label")
    create.add_argument("--admin", action="store_true", help="may change the server (pool, tiers, keys)")
    create.add_argument("--requests-per-minute", type=int)
    create.add_argument("--max-concurrent", type=int)
    create.add_argument("--tokens-per-day", type=int)
    create.add_argument("--models", help="comma-separated model ids or aliases it may use (default: every model)")
    verbs.add("list", "every key: the config's and the database's", do_keys_list, key_verbs)
    revoke = verbs.add("revoke", "a database key answers 401 from now on", do_keys_revoke, key_verbs)
    revoke.add_argument("name", metavar="LABEL|ID")  # not `key`: that is the --key option
    logs = verbs.add("logs", "the request log, oldest first", do_logs)
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new records (Ctrl-C ends)")
    logs.add_argument("-n", "--limit", type=int, default=20, help="how many recent records first (default 20)")
    logs.add_argument("--model")
    logs.add_argument("--route")
    logs.add_argument("--status", help="ok, error, 4xx, 5xx")
    logs.add_argument("--interval", type=float, default=1.0, help="seconds between polls with -f (default 1)")
    verbs.add("status", "health, readiness and the memory summary; status 1 while not ready", do_status)
    batches = verbs.add("batches", "the Batch API's batches, newest first: status, lines done, model", do_batches)
    batches.add_argument("-n", "--limit", type=int, default=20, help="how many (default 20, at most 100)")


def _keys_usage(server: Server, args: argparse.Namespace) -> int:
    raise CliError("keys needs a verb: hypnos keys create LABEL | hypnos keys list | hypnos keys revoke LABEL")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hypnos", description=DESCRIPTION, parents=[_global_options(True)])
    parser.add_argument("--version", action="version", version=f"hypnos {cli_version()}")
    verbs = Verbs(parser, _global_options(False))
    _model_verbs(verbs)
    _server_verbs(verbs)
    return parser


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse gives `run`'s prompt (nargs="*") only the words right after the model: in
    # `hypnos run m --verbose "hi"` the "hi" is left over, and belongs to the prompt.
    if extra and args.verb == "run" and not any(word.startswith("-") for word in extra):
        args.prompt += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    url = args.url or os.environ.get("HYPNOS_URL") or DEFAULT_URL
    server = Server(url, args.key or os.environ.get("HYPNOS_API_KEY") or None)
    handler: Handler = args.handler
    try:
        return handler(server, args)
    except CliError as error:
        print(f"hypnos: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `hypnos logs -f | head`: the reader left; no traceback, and none at exit either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    finally:
        server.close()
