-- fabriclab_mrc.lua: shows the fabriclab lab's MRC (Multipath Reliable Connection)
-- convention in Wireshark. The wire format is documented in traffic/packets.py.
--
--   wireshark -X lua_script:traffic/wireshark/fabriclab_mrc.lua FILE.pcap
--   (or copy this file into ~/.local/lib/wireshark/plugins/)
--
-- MRC frames are RoCE v2, so Wireshark's InfiniBand dissector already decodes the
-- BTH, RETH and ImmDt; it shows the SACK opcode (0xC1, manufacturer-specific) as
-- "Unknown" with the rest as vendor data. This is therefore a postdissector: it
-- runs after InfiniBand, reads that dissector's fields, and adds
--   * on a SACK: the 16-byte SACKX header that follows the BTH;
--   * on a NACK (0xC2): the 4-byte NACKX header (EV, code: 1 = the packet was trimmed);
--   * on a probe (0xC3): the 4-byte PROBEX header (the EV probed, flags: 1 = the answer);
--   * on a credit request (0xC4, RCCC): the 4-byte CREQX header (the sender's backlog in
--     bytes; the BTH PSN is the credit edge it asks for);
--   * on an MRC data packet: the immediate read as message id and packets in the
--     message, a lab convention and not standard RDMA. MRC data is an RDMA WRITE ONLY
--     WITH IMMEDIATE that does not ask for an ACK; an RC one ends a message and does.
--   * on a packet a switch trimmed (its DSCP rewritten to 40, its payload and ICRC cut:
--     InfiniBand's dissector reads its last 4 bytes as the ICRC): fabriclab_mrc.trimmed,
--     and for MRC data the message id and count from the bytes where the ImmDt stands.

-- The values of traffic/constants.py that this file needs (Lua cannot import them).
local ROCE_V2_UDP_PORT = 4791
local OPCODE_MRC_DATA = 0x0B        -- Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE
local OPCODE_MRC_SACK = 0xC1        -- Opcode.MRC_SACK
local OPCODE_MRC_NACK = 0xC2        -- Opcode.MRC_NACK
local OPCODE_MRC_PROBE = 0xC3       -- Opcode.MRC_PROBE
local PROBEX_BYTES = 4              -- MRC_PROBEX_BYTES
local PROBE_FLAG_REPLY = 0x01       -- MRC_PROBE_FLAG_REPLY
local OPCODE_MRC_CREDIT_REQUEST = 0xC4   -- Opcode.MRC_CREDIT_REQUEST
local CREQX_BYTES = 4               -- MRC_CREQX_BYTES
local DSCP_TRIMMED = 40             -- DSCP_TRIMMED
local NACKX_BYTES = 4               -- MRC_NACKX_BYTES
local NACK_CODES = { [1] = "trimmed" }   -- MRC_NACK_CODE_TRIMMED
local RETH_BYTES = 16
local IMMDT_BYTES = 4
local BTH_BYTES = 12
local ICRC_BYTES = 4
local SACKX_BYTES = 16              -- MRC_SACKX_BYTES
local BITMAP_BITS = 64              -- MRC_SACK_BITMAP_BITS
local FLAG_ECN_ECHO = 0x01          -- MRC_SACK_FLAG_ECN_ECHO
local PSN_MODULUS = 0x1000000       -- an integer in every Lua, unlike 2 ^ 24

local mrc = Proto("fabriclab_mrc", "fabriclab MRC (Multipath Reliable Connection)")

local pf = {
    msg_id = ProtoField.uint16("fabriclab_mrc.msg_id", "Message ID", base.DEC),
    msg_packets = ProtoField.uint16("fabriclab_mrc.msg_packets", "Packets in message", base.DEC),
    cum_psn = ProtoField.uint24("fabriclab_mrc.sack.cum_psn", "Cumulative ACK (next PSN expected)",
                                base.DEC),
    bitmap = ProtoField.uint64("fabriclab_mrc.sack.bitmap", "Bitmap", base.HEX),
    acked_psn = ProtoField.uint24("fabriclab_mrc.sack.acked_psn", "PSN arrived", base.DEC),
    ev = ProtoField.uint16("fabriclab_mrc.sack.ev", "Entropy value (UDP source port of the data)",
                           base.DEC),
    flags = ProtoField.uint8("fabriclab_mrc.sack.flags", "Flags", base.HEX),
    ecn_echo = ProtoField.bool("fabriclab_mrc.sack.ecn_echo", "ECN echo (data arrived CE-marked)",
                               8, nil, FLAG_ECN_ECHO),
    reserved = ProtoField.uint8("fabriclab_mrc.sack.reserved", "Reserved", base.HEX),
    credit_psn = ProtoField.uint32("fabriclab_mrc.sack.credit_psn",
                                   "Credit PSN (the sender may send PSNs below it)", base.DEC),
    nack_psn = ProtoField.uint24("fabriclab_mrc.nack.psn", "PSN to resend", base.DEC),
    nack_ev = ProtoField.uint16("fabriclab_mrc.nack.ev", "Entropy value of the packet answered",
                                base.DEC),
    nack_code = ProtoField.uint8("fabriclab_mrc.nack.code", "Code", base.DEC, NACK_CODES),
    nack_flags = ProtoField.uint8("fabriclab_mrc.nack.flags", "Flags", base.HEX),
    trimmed = ProtoField.bool("fabriclab_mrc.trimmed", "Trimmed by a switch (headers only)"),
    probe_ev = ProtoField.uint16("fabriclab_mrc.probe.ev", "Entropy value probed", base.DEC),
    probe_reply = ProtoField.bool("fabriclab_mrc.probe.reply", "Answer (the EV works)", 8, nil,
                                  PROBE_FLAG_REPLY),
    creq_psn = ProtoField.uint24("fabriclab_mrc.creq.psn", "Credit wanted (PSNs below it)",
                                 base.DEC),
    creq_backlog = ProtoField.uint32("fabriclab_mrc.creq.backlog", "Backlog (bytes not sent yet)",
                                     base.DEC),
}
mrc.fields = pf

local truncated = ProtoExpert.new("fabriclab_mrc.truncated", "MRC extension header truncated",
                                  expert.group.MALFORMED, expert.severity.ERROR)
mrc.experts = { truncated }

local f_udp_srcport = Field.new("udp.srcport")
local f_udp_dstport = Field.new("udp.dstport")
local f_infiniband = Field.new("infiniband")
local f_bth = Field.new("infiniband.bth")
local f_opcode = Field.new("infiniband.bth.opcode")
local f_destqp = Field.new("infiniband.bth.destqp")
local f_ackreq = Field.new("infiniband.bth.a")
local f_psn = Field.new("infiniband.bth.psn")
local f_immdt = Field.new("infiniband.immdt")
local f_dscp = Field.new("ip.dsfield.dscp")

-- The UDP source port of the header that carried RoCE v2, or nil when the
-- InfiniBand layer came by another way. Ports pair up by position, so a tunnel's
-- outer UDP header does not confuse them.
local function roce_v2_source_port()
    local sports, dports = { f_udp_srcport() }, { f_udp_dstport() }
    for i, dport in ipairs(dports) do
        if dport.value == ROCE_V2_UDP_PORT then
            return sports[i].value
        end
    end
    return nil
end

local function dissect_data(pinfo, tree, ev)
    local immdt = f_immdt()
    if not immdt or f_ackreq().value then
        return
    end
    local imm = immdt.range
    local id, count = imm:range(0, 2), imm:range(2, 2)
    local subtree = tree:add(mrc, imm, "fabriclab MRC data")
    subtree:add(pf.msg_id, id)
    subtree:add(pf.msg_packets, count)
    pinfo.cols.info:append(string.format(" [MRC msg %d, %d packets, EV %d]",
                                         id:uint(), count:uint(), ev))
end

-- The PSNs a bitmap acknowledges: bit i (least significant = 0) is PSN cum + 1 + i.
local function sacked_psns(bitmap, cum_psn)
    local psns = {}
    for i = 0, BITMAP_BITS - 1 do
        if bitmap:rshift(i):band(1):tonumber() == 1 then
            psns[#psns + 1] = (cum_psn + 1 + i) % PSN_MODULUS
        end
    end
    return psns
end

-- The extension header of `nbytes` after the BTH, under a subtree `name`: the header
-- follows the BTH in the buffer the BTH was read from, and the ICRC follows the header
-- at the end of the InfiniBand packet (the UDP payload). nil (and an expert note) if
-- the packet is too short for it.
local function extension(tree, name, nbytes)
    local ib, bth = f_infiniband(), f_bth()
    local offset = bth.offset + BTH_BYTES
    if ib.offset + ib.len < offset + nbytes + ICRC_BYTES then
        tree:add(mrc, bth.range, name):add_proto_expert_info(truncated)
        return nil
    end
    local header = bth.source:range(offset, nbytes)
    return header, tree:add(mrc, header, name)
end

local function dissect_sack(pinfo, tree)
    local psn = f_psn()
    local sackx, subtree = extension(tree, "fabriclab MRC SACK", SACKX_BYTES)
    if not sackx then
        return
    end
    subtree:add(pf.cum_psn, psn.range)

    local bitmap_range = sackx:range(0, 8)
    local bitmap_item = subtree:add(pf.bitmap, bitmap_range)
    local psns = sacked_psns(bitmap_range:uint64(), psn.value)
    for _, sacked in ipairs(psns) do
        bitmap_item:add(pf.acked_psn, bitmap_range, sacked):set_generated()
    end
    local psn_list = #psns > 0 and table.concat(psns, ", ") or "none"
    bitmap_item:append_text(" (PSNs arrived: " .. psn_list .. ")")

    subtree:add(pf.ev, sackx:range(8, 2))
    subtree:add(pf.flags, sackx:range(10, 1)):add(pf.ecn_echo, sackx:range(10, 1))
    subtree:add(pf.reserved, sackx:range(11, 1))
    subtree:add(pf.credit_psn, sackx:range(12, 4))

    -- A one-bit test by arithmetic: Lua 5.2 and 5.4 share no bit operators.
    local ecn_echo = math.floor(sackx:range(10, 1):uint() / FLAG_ECN_ECHO) % 2 == 1
    pinfo.cols.info:set(string.format("MRC SACK QP=0x%06x cum PSN %d, then arrived: %s, EV %d%s, "
                                      .. "credit PSN %d",
                                      f_destqp().value, psn.value, psn_list,
                                      sackx:range(8, 2):uint(), ecn_echo and ", ECN echo" or "",
                                      sackx:range(12, 4):uint()))
end

local function dissect_nack(pinfo, tree)
    local psn = f_psn()
    local nackx, subtree = extension(tree, "fabriclab MRC NACK", NACKX_BYTES)
    if not nackx then
        return
    end
    subtree:add(pf.nack_psn, psn.range)
    subtree:add(pf.nack_ev, nackx:range(0, 2))
    subtree:add(pf.nack_code, nackx:range(2, 1))
    subtree:add(pf.nack_flags, nackx:range(3, 1))
    local code = nackx:range(2, 1):uint()
    pinfo.cols.info:set(string.format("MRC NACK QP=0x%06x resend PSN %d (%s), EV %d",
                                      f_destqp().value, psn.value, NACK_CODES[code] or "?",
                                      nackx:range(0, 2):uint()))
end

local function dissect_probe(pinfo, tree)
    local probex, subtree = extension(tree, "fabriclab MRC probe", PROBEX_BYTES)
    if not probex then
        return
    end
    subtree:add(pf.probe_ev, probex:range(0, 2))
    subtree:add(pf.probe_reply, probex:range(2, 1))
    local reply = math.floor(probex:range(2, 1):uint() / PROBE_FLAG_REPLY) % 2 == 1
    pinfo.cols.info:set(string.format("MRC probe%s QP=0x%06x EV %d, probe %d",
                                      reply and " answer" or "", f_destqp().value,
                                      probex:range(0, 2):uint(), f_psn().value))
end

local function dissect_credit_request(pinfo, tree)
    local psn = f_psn()
    local creqx, subtree = extension(tree, "fabriclab MRC credit request", CREQX_BYTES)
    if not creqx then
        return
    end
    subtree:add(pf.creq_psn, psn.range)
    subtree:add(pf.creq_backlog, creqx:range(0, 4))
    pinfo.cols.info:set(string.format("MRC credit request QP=0x%06x up to PSN %d, backlog %d bytes",
                                      f_destqp().value, psn.value, creqx:range(0, 4):uint()))
end

-- A trimmed packet: its headers as the sender wrote them, nothing after.
local function dissect_trimmed(pinfo, tree, opcode, ev)
    local bth = f_bth()
    local subtree = tree:add(mrc, bth.range, "fabriclab MRC data, trimmed by a switch")
    subtree:add(pf.trimmed, bth.range, true):set_generated()
    local imm_at = bth.offset + BTH_BYTES + RETH_BYTES
    if opcode == OPCODE_MRC_DATA and bth.source:len() >= imm_at + IMMDT_BYTES then
        local imm = bth.source:range(imm_at, IMMDT_BYTES)
        subtree:add(pf.msg_id, imm:range(0, 2))
        subtree:add(pf.msg_packets, imm:range(2, 2))
        pinfo.cols.info:set(string.format("MRC data TRIMMED QP=0x%06x PSN %d [MRC msg %d, EV %d]",
                                          f_destqp().value, f_psn().value,
                                          imm:range(0, 2):uint(), ev))
    else
        pinfo.cols.info:append(" [TRIMMED]")
    end
end

function mrc.dissector(tvb, pinfo, tree)
    local opcode = f_opcode()
    local sport = opcode and roce_v2_source_port()
    if not sport then
        return
    end
    local dscp = f_dscp()
    if dscp and dscp.value == DSCP_TRIMMED then
        dissect_trimmed(pinfo, tree, opcode.value, sport)
    elseif opcode.value == OPCODE_MRC_SACK then
        dissect_sack(pinfo, tree)
    elseif opcode.value == OPCODE_MRC_NACK then
        dissect_nack(pinfo, tree)
    elseif opcode.value == OPCODE_MRC_PROBE then
        dissect_probe(pinfo, tree)
    elseif opcode.value == OPCODE_MRC_CREDIT_REQUEST then
        dissect_credit_request(pinfo, tree)
    elseif opcode.value == OPCODE_MRC_DATA then
        dissect_data(pinfo, tree, sport)   -- a data packet's source port is its EV
    end
end

register_postdissector(mrc)
