"""`dgr health HOST:PORT`: a worker's grpc.health.v1 status, as an exit code (0: SERVING), for
container health checks, service managers and scripts that wait for a worker."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import grpc
from dgr_route.route import check_addresses
from dgr_route.security import Security
from grpc_health.v1 import health_pb2, health_pb2_grpc


def cmd_health(args: argparse.Namespace) -> int:
    try:
        check_addresses([args.address])
        security = Security.from_files(args.tls_ca, args.tls_cert, args.tls_key, None)
    except (ValueError, OSError) as exc:
        print(f"dgr health: {exc}", file=sys.stderr)
        return 2
    with security.channel(args.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=args.timeout)
        except grpc.RpcError as exc:
            print(f"{args.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def register(sub: Any) -> None:
    p = sub.add_parser("health", help="a worker's grpc.health.v1 status (exit 0: serving)")
    p.add_argument("address", help="HOST:PORT of the worker")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
    p.add_argument("--tls-ca", type=Path, help="PEM CA that signed the worker's certificate")
    p.add_argument("--tls-cert", type=Path, help="PEM client certificate (workers requiring mTLS)")
    p.add_argument("--tls-key", type=Path, help="PEM key of the client certificate")
    p.set_defaults(func=cmd_health)
