"""`moshpeer member`: peer ids, credentials and revocations for a run with an owner (docs/security.md).

- `moshpeer member id --identity FILE`: this peer's id (the file is created if missing), to send to the owner;
- `moshpeer member issue --owner-identity FILE --peer-id ID --out FILE`: the owner signs a credential for ID;
- `moshpeer member revoke --owner-identity FILE --peer-id ID --revoked FILE`: the owner adds ID to the run's
  revocation list, rewritten in place. A node started with `--revoked FILE` (the owner's, e.g. its `moshpeer dht`)
  re-reads it and passes it on in its record; every member passes it on in turn.

Files are written atomically, readable by their owner only. Nothing here touches the network.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

from moshpeer.cli.common import positive_float
from moshpeer.errors import UserError

DEFAULT_DAYS = 30.0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "member",
        help="peer ids, credentials and revocations of a run with an owner",
        description="Manage the members of a run with an owner (--run-owner): print a peer id, issue a credential, "
        "revoke one.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    show = actions.add_parser("id", help="print the peer id of an identity file (created if missing)")
    show.add_argument("--identity", required=True, metavar="FILE", help="the identity file (--identity of join)")
    issue = actions.add_parser("issue", help="sign a credential that admits one peer id")
    issue.add_argument("--owner-identity", required=True, metavar="FILE", help="the run owner's identity file")
    issue.add_argument("--peer-id", required=True, help="the member's peer id (`moshpeer member id`)")
    issue.add_argument("--days", type=positive_float, default=DEFAULT_DAYS,
                       help=f"the credential expires after this many days (default: {DEFAULT_DAYS:g})")
    issue.add_argument("--out", required=True, metavar="FILE", help="where to write the credential")
    revoke = actions.add_parser("revoke", help="add peer ids to the run's revocation list")
    revoke.add_argument("--owner-identity", required=True, metavar="FILE", help="the run owner's identity file")
    revoke.add_argument("--peer-id", required=True, nargs="+", help="the peer ids to revoke")
    revoke.add_argument("--revoked", required=True, metavar="FILE",
                        help="the revocation list: read if it exists, rewritten with these ids added")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # Here, not at the top: building the parsers must not import hivemind or torch (a bad flag fails at once).
    from moshpeer.dht import credentials
    from moshpeer.dht.identity import Identity

    if args.action == "id":
        print(Identity.load_or_create(args.identity).peer_id)
        return 0
    owner = Identity.load(args.owner_identity)
    peer_ids = [args.peer_id] if args.action == "issue" else args.peer_id
    for peer_id in peer_ids:
        if not credentials.PEER_ID.match(peer_id):
            raise UserError(f"--peer-id {peer_id!r:.80} is not a peer id")
    now = time.time()
    if args.action == "issue":
        not_after = now + args.days * 86400
        _write(args.out, credentials.issue_credential(owner, args.peer_id, not_after))
        until = datetime.datetime.fromtimestamp(not_after, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        print(f"credential for {args.peer_id} from run owner {owner.peer_id}, valid until {until}: {args.out}")
        return 0
    revoked, issued_after = set(), 0.0
    if os.path.exists(args.revoked):
        with open(args.revoked, "rb") as f:
            previous = credentials.parse_revocations(f.read(credentials.MAX_REVOCATIONS_BYTES + 1), owner.peer_id)
        if previous is None:
            raise UserError(f"--revoked {args.revoked} is not a revocation list of run owner {owner.peer_id}")
        revoked, issued_after = set(previous.peer_ids), previous.issued_at
    revoked.update(peer_ids)
    try:
        blob = credentials.issue_revocations(owner, revoked, max(now, issued_after + 1e-3))
    except ValueError as e:
        raise UserError(f"{e}: start a new run owner, or let old credentials expire") from None
    _write(args.revoked, blob)
    print(f"{len(revoked)} peer(s) revoked by run owner {owner.peer_id}: {args.revoked}")
    return 0


def _write(path: str, data: bytes) -> None:
    from moshpeer.dht.identity import write_private_file

    path = os.path.abspath(os.path.expanduser(path))
    try:
        write_private_file(path, data)
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror}") from None
