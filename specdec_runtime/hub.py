"""The Hugging Face Hub: whether a push can work (before hours of training), and pushing an export.

    check = check_push("me/drafter")              # check.problems: no token, a read-only one, a repo not yours
    check.unreachable                             # why the Hub could not be asked (no network), else None
    url = push_folder(Path("runs/eagle3/export"), "me/drafter", private=True, revision="v1")
    specdec push runs/eagle3/export me/drafter    # the same from the command line (--public, --revision)

A push first runs `specdec check-export` on the folder and refuses one that an engine it claims
would not load. The token: the argument, else $HF_TOKEN, else the one `hf auth login` stored.
"""

import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from specdec_runtime.errors import SpecdecError
from specdec_runtime.paths import is_hub_id


def hub_token(token: str | None = None) -> str | None:
    from huggingface_hub import get_token

    return token or os.environ.get("HF_TOKEN") or get_token()


@dataclass
class PushCheck:
    problems: list[str] = field(default_factory=list)  # what would make the push fail
    unreachable: str | None = None  # why the Hub could not be asked


def check_push(repo_id: str, token: str | None = None) -> PushCheck:
    """What can be known before training about pushing to repo_id: a token, that it may write, and
    that the repo exists or its namespace is the token owner's (or one of their organizations)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    check = PushCheck()
    if not is_hub_id(repo_id):
        check.problems.append(f"hub.repo_id={repo_id!r} is no Hub repo id: give OWNER/NAME")
        return check
    token = hub_token(token)
    if not token:
        check.problems.append("no Hugging Face token: set HF_TOKEN or run `hf auth login`")
        return check
    api = HfApi(token=token)
    try:
        who = api.whoami()
    except HfHubHTTPError as e:
        status = getattr(e.response, "status_code", None)
        check.problems.append(f"the Hub refused the token (HTTP {status}): set a valid HF_TOKEN")
        return check
    except Exception as e:  # no network, HF_HUB_OFFLINE: httpx's and huggingface_hub's own errors
        check.unreachable = f"{type(e).__name__}: {e}"
        return check
    if ((who.get("auth") or {}).get("accessToken") or {}).get("role") == "read":
        check.problems.append(f"the token of {who.get('name')} is read-only: create a write token")
    owners = {who.get("name")} | {org.get("name") for org in who.get("orgs") or []}
    try:
        api.repo_info(repo_id)
    except RepositoryNotFoundError:
        owner = repo_id.split("/")[0]
        if owner not in owners:
            check.problems.append(
                f"{repo_id} does not exist (or is private) and {who.get('name')} cannot create it under {owner!r}: "
                f"push to one of {', '.join(sorted(o for o in owners if o))}"
            )
    except HfHubHTTPError as e:
        check.problems.append(f"the Hub answered {repo_id} with HTTP {getattr(e.response, 'status_code', '?')}")
    except Exception as e:
        check.unreachable = f"{type(e).__name__}: {e}"
    return check


def push_command(folder: Path, repo_id: str, *, private: bool = True, revision: str | None = None) -> str:
    """The command that pushes (or retries pushing) `folder`."""
    cmd = ["specdec", "push", str(folder), repo_id] + ["--public"] * (not private)
    return shlex.join(cmd + (["--revision", revision] if revision else []))


def push_folder(
    folder: Path,
    repo_id: str,
    *,
    private: bool = True,
    revision: str | None = None,
    token: str | None = None,
    commit_message: str = "Upload drafter trained with specdec",
    check: bool = True,
) -> str:
    """Create the repo if needed and upload the folder (check: refuse one a claimed engine would not
    load, with what `specdec check-export` says); the commit URL."""
    from huggingface_hub import HfApi

    from specdec_runtime.export_check import check_export

    if check:
        report = check_export(folder)
        if not report.ok:
            raise SpecdecError(f"not pushing {folder}: an engine it is for would not load it right\n{report.text()}")
    api = HfApi(token=hub_token(token))
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    if revision:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, revision=revision, commit_message=commit_message)
    return str(getattr(info, "commit_url", info))
