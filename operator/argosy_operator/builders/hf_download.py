"""A stdlib-only Hugging Face Hub downloader, run by `python3 -c` in the init container.

The runtime image has Python but not `huggingface_hub`; this script needs neither. It lists the
repo's files at a revision (`GET {endpoint}/api/models/{repo}/revision/{rev}`), keeps what the
runtime loads (config, tokenizer, safetensors: the shards model.safetensors.index.json lists
when there is one; or the one file asked for), streams each from
`{endpoint}/{repo}/resolve/{rev}/{file}` into a temporary name and renames it, and writes a
marker last, so a restarted pod (the emptyDir survives container restarts) skips the download.
Environment: HF_TOKEN (optional, from spec.model.credentialsSecret), HF_ENDPOINT (optional).
argv: repo revision file-or-empty destination.
"""

from __future__ import annotations

HF_DOWNLOAD_SCRIPT = r'''
import json, os, sys, urllib.parse, urllib.request
repo, rev, only, dest = sys.argv[1:5]
endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
token = os.environ.get("HF_TOKEN", "")
marker = os.path.join(dest, ".argosy-download-complete")
want = f"{repo}@{rev}:{only}"
if os.path.exists(marker) and open(marker).read() == want:
    print(f"model {want} already downloaded"); sys.exit(0)
class SameHostAuth(urllib.request.HTTPRedirectHandler):
    # urllib forwards every header on a redirect. A weights file redirects to a signed CDN
    # URL on another host: the token must not go there (huggingface_hub drops it too); a
    # redirect on the hub itself (a renamed repo) keeps it.
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        moved = urllib.parse.urlsplit(newurl).netloc != urllib.parse.urlsplit(req.full_url).netloc
        if new is not None and moved:
            new.remove_header("Authorization")
        return new
opener = urllib.request.build_opener(SameHostAuth)
def get(url):
    headers = {"User-Agent": "argosy-model-download"}
    if token:
        headers["Authorization"] = "Bearer " + token
    return opener.open(urllib.request.Request(url, headers=headers), timeout=60)
quoted_rev = urllib.parse.quote(rev, safe="")
if only:
    files = [only]
else:
    with get(f"{endpoint}/api/models/{repo}/revision/{quoted_rev}") as r:
        siblings = [s["rfilename"] for s in json.load(r).get("siblings", [])]
    keep = (".json", ".safetensors", ".txt", ".model", ".tiktoken", ".jinja")
    files = [f for f in siblings if f.endswith(keep) and not f.startswith(".")]
    if not any(f.endswith(".safetensors") for f in files):
        sys.exit(f"{repo}@{rev} has no .safetensors weights")
    index = "model.safetensors.index.json"
    if index in files:
        # The runtime loads only the shards the index lists. Some repos also hold the same
        # weights in another layout (Mistral's consolidated.safetensors): fetched too, they
        # doubled the download and could overflow the emptyDir's cacheSizeLimit.
        with get(f"{endpoint}/{repo}/resolve/{quoted_rev}/{index}") as r:
            shards = set(json.load(r)["weight_map"].values())
        files = [f for f in files if not f.endswith(".safetensors") or f in shards]
os.makedirs(dest, exist_ok=True)
for name in files:
    path = os.path.join(dest, name)
    if os.path.normpath(path) != path or not path.startswith(dest + "/"):
        sys.exit(f"refusing unsafe file name {name!r}")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    url = f"{endpoint}/{repo}/resolve/{quoted_rev}/{urllib.parse.quote(name)}"
    with get(url) as r, open(path + ".part", "wb") as f:
        size = 0
        while chunk := r.read(1 << 20):
            f.write(chunk); size += len(chunk)
    os.replace(path + ".part", path)
    print(f"downloaded {name} ({size} bytes)", flush=True)
with open(marker, "w") as f:
    f.write(want)
'''
