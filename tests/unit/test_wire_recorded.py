"""Old peers keep working: request frames recorded from the client as it was before the
records were unified (issue 15) still decode into the same requests and re-encode to the same
bytes, and log records written by that server still replay into the same commands.

The hex literals were produced by the client's own encode path (``wire.to_mapping`` of each
request, framed as the stream protocol sends it; the HTTP body is the frame's last element)
and by the service's log record (``{"cmd": command.to_record(), "now", "rid"}``). Never
regenerate them: a change that breaks one of these is a wire or log format change.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from rdzv_client import wire
from rdzv_server.core import command as c

def flat(record: Any, leave_out: str) -> dict[str, Any]:
    """A record's field values by name, an inline record's (the job settings) spelled in its
    place, as the wire (``leave_out="wire"``) or the log (``"log"``) spells them: the recorded
    values compare with it."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(record):
        if not f.metadata.get(leave_out, True):
            continue
        value = getattr(record, f.name)
        if f.metadata.get("omit_default") and value == f.default:
            continue  # a field added later (record.optional), at its default: not in the bytes
        if f.metadata.get("inline"):
            out.update(flat(value, leave_out))
        else:
            out[f.name] = value
    return out


RECORDED_FRAMES: list[tuple[str, dict[str, Any], str]] = [
    ('join', {'node_id': 'n1', 'addr': '10.0.0.1', 'nproc_per_node': 8, 'min_nodes': 2, 'max_nodes': 4, 'last_call_timeout': 30.0, 'join_timeout': 600.0, 'heartbeat_ttl': 15.0, 'hold': 30.0, 'rid': ('c1', 1, 1), 'master_port': 29500},
     "000000bc9401a46a6f696ea56a6f622d318ba76e6f64655f6964a26e31a461646472a831302e302e302e31ae6e70726f635f7065725f6e6f646508a96d696e5f6e6f64657302a96d61785f6e6f64657304b16c6173745f63616c6c5f74696d656f7574cb403e000000000000ac6a6f696e5f74696d656f7574cb4082c00000000000ad6865617274626561745f74746ccb402e000000000000a4686f6c64cb403e000000000000a372696493a263310101ab6d61737465725f706f7274cd733c"),
    ('create', {'min_nodes': 2, 'max_nodes': 4, 'last_call_timeout': 30.0, 'join_timeout': 600.0, 'heartbeat_ttl': 15.0, 'rid': ('c1', 2, 2)},
     "000000789402a6637265617465a56a6f622d3186a96d696e5f6e6f64657302a96d61785f6e6f64657304b16c6173745f63616c6c5f74696d656f7574cb403e000000000000ac6a6f696e5f74696d656f7574cb4082c00000000000ad6865617274626561745f74746ccb402e000000000000a372696493a263310202"),
    ('set', {'key': b'k', 'value': b'\x00v', 'round': 1, 'rid': ('c1', 3, 3)},
     "0000002f9403a3736574a56a6f622d3184a36b6579c4016ba576616c7565c4020076a5726f756e6401a372696493a263310303"),
    ('add', {'key': b'ctr', 'amount': -5, 'round': None, 'rid': ('c1', 4, 4)},
     "0000002f9404a3616464a56a6f622d3184a36b6579c403637472a6616d6f756e74fba5726f756e64c0a372696493a263310404"),
    ('compare_set', {'key': b'k', 'expected': b'', 'desired': b'd', 'round': None, 'rid': ('c1', 5, 5)},
     "000000439405ab636f6d706172655f736574a56a6f622d3185a36b6579c4016ba86578706563746564c400a764657369726564c40164a5726f756e64c0a372696493a263310505"),
    ('append', {'key': b'k', 'value': b'more', 'round': None, 'rid': ('c1', 6, 6)},
     "000000349406a6617070656e64a56a6f622d3184a36b6579c4016ba576616c7565c4046d6f7265a5726f756e64c0a372696493a263310606"),
    ('multi_set', {'keys': (b'a', b'b'), 'values': (b'1', b'2'), 'round': 3, 'rid': ('c1', 7, 6)},
     "0000003e9407a96d756c74695f736574a56a6f622d3184a46b65797392c40161c40162a676616c75657392c40131c40132a5726f756e6403a372696493a263310706"),
    ('delete_key', {'key': b'k', 'round': None, 'rid': ('c1', 8, 8)},
     "0000002c9408aa64656c6574655f6b6579a56a6f622d3183a36b6579c4016ba5726f756e64c0a372696493a263310808"),
    ('get', {'key': b'k', 'timeout': 2.5, 'round': None},
     "0000002c9409a3676574a56a6f622d3183a36b6579c4016ba774696d656f7574cb4004000000000000a5726f756e64c0"),
    ('multi_get', {'keys': (b'a', b'b'), 'timeout': 1.0, 'round': None},
     "00000037940aa96d756c74695f676574a56a6f622d3183a46b65797392c40161c40162a774696d656f7574cb3ff0000000000000a5726f756e64c0"),
    ('wait', {'keys': (b'a',), 'timeout': 1.0, 'round': 2},
     "0000002f940ba477616974a56a6f622d3183a46b65797391c40161a774696d656f7574cb3ff0000000000000a5726f756e6402"),
    ('check', {'keys': (b'a',), 'round': None},
     "0000001f940ca5636865636ba56a6f622d3182a46b65797391c40161a5726f756e64c0"),
    ('num_keys', {'round': None},
     "00000019940da86e756d5f6b657973a56a6f622d3181a5726f756e64c0"),
    ('list_keys', {'prefix': b'p/', 'round': None},
     "00000025940ea96c6973745f6b657973a56a6f622d3182a6707265666978c402702fa5726f756e64c0"),
    ('await_round', {'node_id': 'n1', 'round': 1, 'hold': 10.0},
     "00000035940fab61776169745f726f756e64a56a6f622d3183a76e6f64655f6964a26e31a5726f756e6401a4686f6c64cb4024000000000000"),
    ('watch', {'node_id': 'n1', 'round': 1, 'known': 0, 'hold': 20.0},
     "000000369410a57761746368a56a6f622d3184a76e6f64655f6964a26e31a5726f756e6401a56b6e6f776e00a4686f6c64cb4034000000000000"),
    ('leave', {'node_id': 'n1', 'rid': ('c1', 9, 9)},
     "000000249411a56c65617665a56a6f622d3182a76e6f64655f6964a26e31a372696493a263310909"),
    ('close', {'cause': 'agent', 'rid': ('c1', 10, 10)},
     "000000259412a5636c6f7365a56a6f622d3182a56361757365a56167656e74a372696493a263310a0a"),
    # Recorded at issue 16 (fleet control): a join naming its host, topology and the job's restart budget,
    # and the refusal a node sends when its health check fails.
    ('join', {'node_id': 'n2', 'addr': '10.0.0.2', 'nproc_per_node': 4, 'min_nodes': 2, 'max_nodes': 4, 'last_call_timeout': 30.0, 'join_timeout': 600.0, 'heartbeat_ttl': 15.0, 'max_restarts': 2, 'hold': 30.0, 'rid': ('c1', 11, 11), 'master_port': 29501, 'host': 'gpu-node7', 'topology': 'zone1/rack12/switch3'},
     "000000f79414a46a6f696ea56a6f622d318ea76e6f64655f6964a26e32a461646472a831302e302e302e32ae6e70726f635f7065725f6e6f646504a96d696e5f6e6f64657302a96d61785f6e6f64657304b16c6173745f63616c6c5f74696d656f7574cb403e000000000000ac6a6f696e5f74696d656f7574cb4082c00000000000ad6865617274626561745f74746ccb402e000000000000ac6d61785f726573746172747302a4686f6c64cb403e000000000000a372696493a263310b0bab6d61737465725f706f7274cd733da4686f7374a96770752d6e6f646537a8746f706f6c6f6779b47a6f6e65312f7261636b31322f73776974636833"),
    ('refuse', {'node_id': 'n3', 'addr': '10.0.0.3', 'cause': 'health_check_failed', 'detail': 'ECC errors on GPU 2', 'min_nodes': 2, 'max_nodes': 4, 'last_call_timeout': 30.0, 'join_timeout': 600.0, 'heartbeat_ttl': 15.0, 'host': 'gpu-node8', 'rid': ('c1', 12, 12)},
     "000000d59414a6726566757365a56a6f622d318ba76e6f64655f6964a26e33a461646472a831302e302e302e33a56361757365b36865616c74685f636865636b5f6661696c6564a664657461696cb3454343206572726f7273206f6e204750552032a96d696e5f6e6f64657302a96d61785f6e6f64657304b16c6173745f63616c6c5f74696d656f7574cb403e000000000000ac6a6f696e5f74696d656f7574cb4082c00000000000ad6865617274626561745f74746ccb402e000000000000a4686f7374a96770752d6e6f646538a372696493a263310c0c"),
    # Recorded at issue 27 (a crash loop stops itself): the crash-loop settings, a re-join's step, a beat's step.
    ('join', {'node_id': 'n4', 'addr': '10.0.0.4', 'nproc_per_node': 8, 'min_nodes': 2, 'max_nodes': 4, 'last_call_timeout': 30.0, 'join_timeout': 600.0, 'heartbeat_ttl': 15.0, 'max_restarts': 20, 'min_round_seconds': 60.0, 'max_fast_failures': 5, 'hold': 30.0, 'rid': ('c1', 13, 13), 'master_port': 29502, 'step': 1200},
     "000001009415a46a6f696ea56a6f622d318fa76e6f64655f6964a26e34a461646472a831302e302e302e34ae6e70726f635f7065725f6e6f646508a96d696e5f6e6f64657302a96d61785f6e6f64657304b16c6173745f63616c6c5f74696d656f7574cb403e000000000000ac6a6f696e5f74696d656f7574cb4082c00000000000ad6865617274626561745f74746ccb402e000000000000ac6d61785f726573746172747314b16d696e5f726f756e645f7365636f6e6473cb404e000000000000b16d61785f666173745f6661696c7572657305a4686f6c64cb403e000000000000a372696493a263310d0dab6d61737465725f706f7274cd733ea473746570cd04b0"),
    ('watch', {'node_id': 'n4', 'round': 3, 'known': 0, 'hold': 0.0, 'step': 1250},
     "0000003e9416a57761746368a56a6f622d3185a76e6f64655f6964a26e34a5726f756e6403a56b6e6f776e00a4686f6c64cb0000000000000000a473746570cd04e2"),
    # Recorded at issue 29 (beats that need no answer): the one-way beat, with its step.
    ('beat', {'node_id': 'n4', 'round': 3, 'step': 1250},
     "000000289417a462656174a56a6f622d3183a76e6f64655f6964a26e34a5726f756e6403a473746570cd04e2"),
    # Recorded at issue 29's second session: a node reads its job's policy on its stream.
    ('policy', {},
     "000000109418a6706f6c696379a56a6f622d3180"),
]

RECORDED_LOG_RECORDS: list[tuple[str, dict[str, Any], str]] = [
    ('create', {'rdzv_id': 'j', 'min_nodes': 1, 'max_nodes': 2, 'last_call_timeout': 30.0, 'join_timeout': 600.0, 'heartbeat_ttl': 15.0},
     "83a3636d6487a772647a765f6964a16aa96d696e5f6e6f64657301a96d61785f6e6f64657302b16c6173745f63616c6c5f74696d656f7574cb403e000000000000ac6a6f696e5f74696d656f7574cb4082c00000000000ad6865617274626561745f74746ccb402e000000000000a26f70a6637265617465a36e6f77cb4029000000000000a372696493a263310100"),
    ('join', {'rdzv_id': 'j', 'node_id': 'n1', 'addr': 'h1', 'nproc_per_node': 8, 'min_nodes': 1, 'max_nodes': 2, 'last_call_timeout': 30.0, 'join_timeout': 600.0, 'heartbeat_ttl': 15.0, 'master_port': 29500},
     "83a3636d648ba772647a765f6964a16aa76e6f64655f6964a26e31a461646472a26831ae6e70726f635f7065725f6e6f646508a96d696e5f6e6f64657301a96d61785f6e6f64657302b16c6173745f63616c6c5f74696d656f7574cb403e000000000000ac6a6f696e5f74696d656f7574cb4082c00000000000ad6865617274626561745f74746ccb402e000000000000ab6d61737465725f706f7274cd733ca26f70a46a6f696ea36e6f77cb4029000000000000a372696493a263310100"),
    ('set', {'rdzv_id': 'j', 'key': b'k', 'value': b'v', 'round': 1},
     "83a3636d6485a772647a765f6964a16aa36b6579c4016ba576616c7565c40176a5726f756e6401a26f70a3736574a36e6f77cb4029000000000000a372696493a263310100"),
    ('add', {'rdzv_id': 'j', 'key': b'k', 'amount': 3, 'round': None},
     "83a3636d6485a772647a765f6964a16aa36b6579c4016ba6616d6f756e7403a5726f756e64c0a26f70a3616464a36e6f77cb4029000000000000a372696493a263310100"),
    ('compare_set', {'rdzv_id': 'j', 'key': b'k', 'expected': b'', 'desired': b'd', 'round': None},
     "83a3636d6486a772647a765f6964a16aa36b6579c4016ba86578706563746564c400a764657369726564c40164a5726f756e64c0a26f70ab636f6d706172655f736574a36e6f77cb4029000000000000a372696493a263310100"),
    ('append', {'rdzv_id': 'j', 'key': b'k', 'value': b'v', 'round': None},
     "83a3636d6485a772647a765f6964a16aa36b6579c4016ba576616c7565c40176a5726f756e64c0a26f70a6617070656e64a36e6f77cb4029000000000000a372696493a263310100"),
    ('multi_set', {'rdzv_id': 'j', 'keys': (b'a', b'b'), 'values': (b'1', b'2'), 'round': None},
     "83a3636d6485a772647a765f6964a16aa46b65797392c40161c40162a676616c75657392c40131c40132a5726f756e64c0a26f70a96d756c74695f736574a36e6f77cb4029000000000000a372696493a263310100"),
    ('delete_key', {'rdzv_id': 'j', 'key': b'k', 'round': None},
     "83a3636d6484a772647a765f6964a16aa36b6579c4016ba5726f756e64c0a26f70aa64656c6574655f6b6579a36e6f77cb4029000000000000a372696493a263310100"),
    ('leave', {'rdzv_id': 'j', 'node_id': 'n1'},
     "83a3636d6483a772647a765f6964a16aa76e6f64655f6964a26e31a26f70a56c65617665a36e6f77cb4029000000000000a372696493a263310100"),
    ('close', {'rdzv_id': 'j', 'cause': 'agent'},
     "83a3636d6483a772647a765f6964a16aa56361757365a56167656e74a26f70a5636c6f7365a36e6f77cb4029000000000000a372696493a263310100"),
    ('last_call', {'rdzv_id': 'j', 'round': 2},
     "83a3636d6483a772647a765f6964a16aa5726f756e6402a26f70a96c6173745f63616c6ca36e6f77cb4029000000000000a372696493a263310100"),
    ('expire', {'rdzv_id': 'j', 'node_ids': ('n1', 'n2'), 'why': 'dead', 'cause': 'ttl'},
     "83a3636d6485a772647a765f6964a16aa86e6f64655f69647392a26e31a26e32a3776879a464656164a56361757365a374746ca26f70a6657870697265a36e6f77cb4029000000000000a372696493a263310100"),
    ('collect', {'rdzv_id': 'j'},
     "83a3636d6482a772647a765f6964a16aa26f70a7636f6c6c656374a36e6f77cb4029000000000000a372696493a263310100"),
    ('refused', {'rdzv_id': 'j', 'node_id': 'n3', 'addr': 'h3', 'why': 'settings_conflict', 'detail': 'min_nodes'},
     "83a3636d6486a772647a765f6964a16aa76e6f64655f6964a26e33a461646472a26833a3776879b173657474696e67735f636f6e666c696374a664657461696ca96d696e5f6e6f646573a26f70a772656675736564a36e6f77cb4029000000000000a372696493a263310100"),
    ('restarted', {'rdzv_id': '', 'cause': 'leader_changed', 'detail': 'r2'},
     "83a3636d6484a772647a765f6964a0a56361757365ae6c65616465725f6368616e676564a664657461696ca27232a26f70a9726573746172746564a36e6f77cb4029000000000000a372696493a263310100"),
    ('tick', {'rdzv_id': ''},
     "83a3636d6482a772647a765f6964a0a26f70a47469636ba36e6f77cb4029000000000000a372696493a263310100"),
    # Recorded at issue 16 (fleet control).
    ('join', {'rdzv_id': 'j', 'node_id': 'n2', 'addr': 'h2', 'nproc_per_node': 4, 'min_nodes': 1, 'max_nodes': 2, 'last_call_timeout': 30.0, 'join_timeout': 600.0, 'heartbeat_ttl': 15.0, 'max_restarts': 2, 'master_port': 29501, 'host': 'node7', 'topology': 'z1/r2'},
     "83a3636d648ea772647a765f6964a16aa76e6f64655f6964a26e32a461646472a26832ae6e70726f635f7065725f6e6f646504a96d696e5f6e6f64657301a96d61785f6e6f64657302b16c6173745f63616c6c5f74696d656f7574cb403e000000000000ac6a6f696e5f74696d656f7574cb4082c00000000000ad6865617274626561745f74746ccb402e000000000000ac6d61785f726573746172747302ab6d61737465725f706f7274cd733da4686f7374a56e6f646537a8746f706f6c6f6779a57a312f7232a26f70a46a6f696ea36e6f77cb4029000000000000a372696493a263310100"),
    ('refuse', {'rdzv_id': 'j', 'node_id': 'n3', 'addr': 'h3', 'cause': 'health_check_failed', 'detail': 'ECC errors', 'min_nodes': 1, 'max_nodes': 2, 'last_call_timeout': 30.0, 'join_timeout': 600.0, 'heartbeat_ttl': 15.0},
     "83a3636d648ba772647a765f6964a16aa76e6f64655f6964a26e33a461646472a26833a56361757365b36865616c74685f636865636b5f6661696c6564a664657461696caa454343206572726f7273a96d696e5f6e6f64657301a96d61785f6e6f64657302b16c6173745f63616c6c5f74696d656f7574cb403e000000000000ac6a6f696e5f74696d656f7574cb4082c00000000000ad6865617274626561745f74746ccb402e000000000000a26f70a6726566757365a36e6f77cb4029000000000000a372696493a263310100"),
    ('cordon', {'rdzv_id': '', 'host': 'node7', 'reason': 'bad DIMM', 'duration': 3600.0, 'by': 'operator'},
     "83a3636d6486a772647a765f6964a0a4686f7374a56e6f646537a6726561736f6ea86261642044494d4da86475726174696f6ecb40ac200000000000a26279a86f70657261746f72a26f70a6636f72646f6ea36e6f77cb4029000000000000a372696493a263310100"),
    ('cordon', {'rdzv_id': 'j', 'host': 'h3', 'reason': '3 deaths', 'duration': 3600.0, 'by': 'flapping'},
     "83a3636d6486a772647a765f6964a16aa4686f7374a26833a6726561736f6ea83320646561746873a86475726174696f6ecb40ac200000000000a26279a8666c617070696e67a26f70a6636f72646f6ea36e6f77cb4029000000000000a372696493a263310100"),
    ('uncordon', {'rdzv_id': '', 'host': 'node7'},
     "83a3636d6483a772647a765f6964a0a4686f7374a56e6f646537a26f70a8756e636f72646f6ea36e6f77cb4029000000000000a372696493a263310100"),
    # Recorded at issue 27 (a crash loop stops itself).
    ('join', {'rdzv_id': 'j', 'node_id': 'n4', 'addr': 'h4', 'nproc_per_node': 8, 'min_nodes': 1, 'max_nodes': 2, 'last_call_timeout': 30.0, 'join_timeout': 600.0, 'heartbeat_ttl': 15.0, 'min_round_seconds': 60.0, 'max_fast_failures': 5, 'master_port': 29502, 'step': 1200},
     "83a3636d648ea772647a765f6964a16aa76e6f64655f6964a26e34a461646472a26834ae6e70726f635f7065725f6e6f646508a96d696e5f6e6f64657301a96d61785f6e6f64657302b16c6173745f63616c6c5f74696d656f7574cb403e000000000000ac6a6f696e5f74696d656f7574cb4082c00000000000ad6865617274626561745f74746ccb402e000000000000b16d696e5f726f756e645f7365636f6e6473cb404e000000000000b16d61785f666173745f6661696c7572657305ab6d61737465725f706f7274cd733ea473746570cd04b0a26f70a46a6f696ea36e6f77cb4029000000000000a372696493a263310100"),
    # Recorded at issue 28 (job policy lives on the server).
    ('set_policy', {'rdzv_id': '', 'pattern': 'llm-*', 'settings': {'min_nodes': 2, 'max_restarts': 3, 'last_call_timeout': 5.0, 'gpu_check': True}, 'by': 'operator'},
     "83a3636d6485a772647a765f6964a0a77061747465726ea56c6c6d2d2aa873657474696e677384a96d696e5f6e6f64657302ac6d61785f726573746172747303b16c6173745f63616c6c5f74696d656f7574cb4014000000000000a96770755f636865636bc3a26279a86f70657261746f72a26f70aa7365745f706f6c696379a36e6f77cb4029000000000000a372696493a263310100"),
    ('unset_policy', {'rdzv_id': '', 'pattern': 'llm-*', 'keys': ('max_restarts',), 'by': 'operator'},
     "83a3636d6485a772647a765f6964a0a77061747465726ea56c6c6d2d2aa46b65797391ac6d61785f7265737461727473a26279a86f70657261746f72a26f70ac756e7365745f706f6c696379a36e6f77cb4029000000000000a372696493a263310100"),
]


@pytest.mark.parametrize(("op", "fields", "hexed"), RECORDED_FRAMES, ids=[r[0] for r in RECORDED_FRAMES])
def test_a_frame_recorded_from_the_old_client_decodes_into_the_same_request(
    op: str, fields: dict[str, Any], hexed: str
) -> None:
    data = bytes.fromhex(hexed)
    (length,) = wire.FRAME_HEADER.unpack(data[: wire.FRAME_HEADER.size])
    assert length == len(data) - wire.FRAME_HEADER.size
    tag, frame_op, rdzv_id, body = wire.unpack(data[wire.FRAME_HEADER.size :], 1 << 20)
    assert (frame_op, rdzv_id) == (op, "job-1")
    req = wire.decode_request(op, body, rdzv_id)
    assert req.op == op
    assert flat(req, "wire") == fields
    if req.writes:  # the request is the command: it names its job, and is logged and replayed as it is
        assert isinstance(req, c.Command) and req.rdzv_id == "job-1"
        replayed = c.from_record(wire.unpack(wire.pack(req.to_record()), 1 << 20))
        assert replayed == dataclasses.replace(req, **{f.name: f.default for f in dataclasses.fields(req) if f.metadata.get("log") is False})
    # and today's client sends the very same bytes for the same request
    assert wire.frame([tag, op, rdzv_id, wire.to_mapping(req)]) == data


def test_every_operation_has_a_recorded_frame() -> None:
    assert {op for op, _, _ in RECORDED_FRAMES} == set(wire.REQUESTS)


@pytest.mark.parametrize(("op", "fields", "hexed"), RECORDED_LOG_RECORDS, ids=[r[0] for r in RECORDED_LOG_RECORDS])
def test_a_log_record_written_before_replays_into_the_same_command(op: str, fields: dict[str, Any], hexed: str) -> None:
    record = wire.unpack(bytes.fromhex(hexed), 1 << 20)
    assert (record["now"], record["rid"]) == (12.5, ["c1", 1, 0])
    cmd = c.from_record(record["cmd"])
    assert cmd.op == op
    assert flat(cmd, "log") == fields
    # and today's server writes the very same record for the same command
    assert wire.pack({"cmd": cmd.to_record(), "now": 12.5, "rid": ["c1", 1, 0]}) == bytes.fromhex(hexed)


def test_every_command_has_a_recorded_log_record() -> None:
    assert {op for op, _, _ in RECORDED_LOG_RECORDS} == set(c.COMMANDS)


def test_the_job_settings_are_spelled_inline_on_the_wire_and_a_join_must_name_its_node_counts() -> None:
    """One JobSettings record inside create and join, its fields spelled beside the others as
    old clients send them; a join without min_nodes or max_nodes is refused as it always was,
    a create without them takes the one set of defaults."""
    assert list(wire.wire_fields(wire.JoinRequest))[3:8] == [
        "min_nodes", "max_nodes", "last_call_timeout", "join_timeout", "heartbeat_ttl"
    ]
    body = {"node_id": "n", "addr": "h", "nproc_per_node": 1, "max_nodes": 2}
    with pytest.raises(wire.WireError, match="missing field 'min_nodes' for JoinRequest"):
        wire.decode_request("join", body)
    assert wire.decode_request("create", {}, "j") == wire.CreateJobRequest("j", wire.JobSettings())
    join = wire.decode_request("join", {**body, "min_nodes": 1})
    assert isinstance(join, wire.JoinRequest)
    assert join.settings == wire.JobSettings(1, 2)


# Recorded at issue 29 (a join that parks the node's next watch): a join and an await_round
# carrying ``then_watch`` as the plug-in's transport sends them, with the watch's tag and hold.
RECORDED_THEN_WATCH_FRAMES: list[tuple[str, dict[str, Any], tuple[int, float], str]] = [
    ('join', {'node_id': 'n4', 'addr': '10.0.0.4', 'nproc_per_node': 8, 'min_nodes': 2, 'max_nodes': 4, 'last_call_timeout': 30.0, 'join_timeout': 600.0, 'heartbeat_ttl': 15.0, 'hold': 1800.0, 'rid': ('c1', 14, 14), 'master_port': 29502},
     (24, 1800.0),
     "000000d29417a46a6f696ea56a6f622d318ca76e6f64655f6964a26e34a461646472a831302e302e302e34ae6e70726f635f7065725f6e6f646508a96d696e5f6e6f64657302a96d61785f6e6f64657304b16c6173745f63616c6c5f74696d656f7574cb403e000000000000ac6a6f696e5f74696d656f7574cb4082c00000000000ad6865617274626561745f74746ccb402e000000000000a4686f6c64cb409c200000000000a372696493a263310e0eab6d61737465725f706f7274cd733eaa7468656e5f77617463689218cb409c200000000000"),
    ('await_round', {'node_id': 'n4', 'round': 3, 'hold': 1800.0},
     (22, 1800.0),
     "0000004b9415ab61776169745f726f756e64a56a6f622d3184a76e6f64655f6964a26e34a5726f756e6403a4686f6c64cb409c200000000000aa7468656e5f77617463689216cb409c200000000000"),
]


@pytest.mark.parametrize(("op", "fields", "then", "hexed"), RECORDED_THEN_WATCH_FRAMES, ids=[r[0] for r in RECORDED_THEN_WATCH_FRAMES])
def test_a_frame_carrying_then_watch_splits_into_the_watch_and_the_same_request(
    op: str, fields: dict[str, Any], then: tuple[int, float], hexed: str
) -> None:
    """The stream layer takes ``then_watch`` out (``wire.then_watch_of``, as the server does);
    what is left is the request as before, and today's client sends the same bytes."""
    data = bytes.fromhex(hexed)
    tag, frame_op, rdzv_id, body = wire.unpack(data[wire.FRAME_HEADER.size :], 1 << 20)
    assert frame_op == op and op in wire.THEN_WATCH_OPS
    assert wire.then_watch_of(body.pop(wire.THEN_WATCH), tag) == then
    req = wire.decode_request(op, body, rdzv_id)
    assert flat(req, "wire") == fields
    sent = wire.to_mapping(req)
    if "rid" in fields:
        sent["rid"] = list(fields["rid"])
    assert wire.frame([tag, op, rdzv_id, {**sent, wire.THEN_WATCH: list(then)}]) == data


def test_a_hello_reply_says_whether_the_server_takes_then_watch() -> None:
    """This server's hello reply lists then_watch; one from before (``{"access", "one_way"}``,
    or ``{"access"}`` alone) does not, and the client then sends none."""
    assert wire.takes_then_watch({"access": "write", "one_way": ["beat"], "then_watch": ["join", "await_round"]})
    assert not wire.takes_then_watch({"access": "write", "one_way": ["beat"]})
    assert not wire.takes_then_watch({"access": "write"})
    assert not wire.takes_then_watch({"access": "write", "then_watch": ["join"]})  # await_round's re-polls too


def test_a_hello_reply_says_the_servers_policy_version_only_when_it_serves() -> None:
    """A serving server's hello reply says its job-policy version (0: no policy ever set, so a
    node starting fetches none); one from before, or from a server not serving, says nothing
    and the node fetches the policy as before."""
    this = {"access": "write", "one_way": ["beat"], "then_watch": ["join", "await_round"], "policy_version": 0}
    assert wire.hello_policy_version(this) == 0
    assert wire.hello_policy_version({**this, "policy_version": 7}) == 7
    assert wire.hello_policy_version({"access": "write", "one_way": ["beat"], "then_watch": ["join", "await_round"]}) is None
    for unreadable in (-1, "0", 1.0, None, True):
        assert wire.hello_policy_version({**this, "policy_version": unreadable}) is None
    assert wire.hello_policy_version(None) is None
