package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	cdispec "tags.cncf.io/container-device-interface/specs-go"
)

// driver implements kubeletplugin.DRAPlugin. The helper serializes its calls (its default), so
// the checkpoint needs no lock of its own.
type driver struct {
	name       string
	pool       string
	cdiDir     string
	checkpoint checkpointFile
	attributes map[string]map[string]resourceapi.DeviceAttribute
}

var _ kubeletplugin.DRAPlugin = (*driver)(nil)

// cdiClass is the CDI class of the per-claim specs: their devices are named <claim UID>-<device>.
const cdiClass = "claim"

func (d *driver) PrepareResourceClaims(ctx context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	out := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	for _, claim := range claims {
		devices, err := d.prepare(claim)
		out[claim.UID] = kubeletplugin.PrepareResult{Devices: devices, Err: err}
	}
	return out, nil
}

// prepare is one claim's work: the checkpoint is read and checked first (another process may
// have written it since: the state lives on disk, not in this process), a claim it already holds
// is answered from it, else the claim's CDI spec is written and then the checkpoint with it.
func (d *driver) prepare(claim *resourceapi.ResourceClaim) ([]kubeletplugin.Device, error) {
	state, err := d.checkpoint.load()
	if err != nil {
		return nil, err
	}
	uid := string(claim.UID)
	if prepared, ok := state.Claims[uid]; ok {
		return d.devices(uid, prepared), nil
	}
	prepared, err := d.plan(claim)
	if err != nil {
		return nil, err
	}
	if err := d.writeSpec(uid, prepared); err != nil {
		return nil, err
	}
	state.Claims[uid] = prepared
	if err := d.checkpoint.store(state); err != nil {
		return nil, err
	}
	return d.devices(uid, prepared), nil
}

// plan lists the claim's devices of this driver and node from its allocation.
func (d *driver) plan(claim *resourceapi.ResourceClaim) (preparedClaim, error) {
	p := preparedClaim{Namespace: claim.Namespace, Name: claim.Name}
	if claim.Status.Allocation == nil {
		return p, errors.New("the claim is not allocated")
	}
	for _, result := range claim.Status.Allocation.Devices.Results {
		if result.Driver != d.name {
			continue
		}
		if result.Pool != d.pool {
			return p, fmt.Errorf("device %s of pool %q is not on this node", result.Device, result.Pool)
		}
		dev := preparedDevice{Request: result.Request, Pool: result.Pool, Device: result.Device}
		if result.ShareID != nil {
			dev.ShareID = string(*result.ShareID)
		}
		p.Devices = append(p.Devices, dev)
	}
	return p, nil
}

func (d *driver) cdiName(uid string, dev preparedDevice) string {
	name := uid + "-" + dev.Device
	if dev.ShareID != "" {
		name += "-" + dev.ShareID
	}
	return name
}

func (d *driver) specPath(uid string) string {
	return filepath.Join(d.cdiDir, fmt.Sprintf("%s-%s_%s.json", d.name, cdiClass, uid))
}

// writeSpec writes the claim's CDI spec: one CDI device per allocated device, whose edits tell
// the container which device (and share) it got.
func (d *driver) writeSpec(uid string, p preparedClaim) error {
	spec := cdispec.Spec{Kind: d.name + "/" + cdiClass}
	for i, dev := range p.Devices {
		env := []string{
			fmt.Sprintf("DRA_DEVICE_%d=%s", i, dev.Device),
			"DRA_CLAIM=" + p.Namespace + "/" + p.Name,
			"DRA_REQUEST=" + dev.Request,
		}
		if dev.ShareID != "" {
			env = append(env, "DRA_SHARE_ID="+dev.ShareID)
		}
		spec.Devices = append(spec.Devices, cdispec.Device{
			Name:           d.cdiName(uid, dev),
			ContainerEdits: cdispec.ContainerEdits{Env: env},
		})
	}
	version, err := cdispec.MinimumRequiredVersion(&spec)
	if err != nil {
		return fmt.Errorf("CDI spec version: %w", err)
	}
	spec.Version = version
	data, err := json.Marshal(&spec)
	if err != nil {
		return err
	}
	return writeAtomically(d.specPath(uid), data, 0o644)
}

// devices is the answer to the kubelet. The helper adds the CDI ID of the metadata spec when it
// writes device metadata, with the attributes given here (those the device is published with).
func (d *driver) devices(uid string, p preparedClaim) []kubeletplugin.Device {
	out := make([]kubeletplugin.Device, 0, len(p.Devices))
	for _, dev := range p.Devices {
		device := kubeletplugin.Device{
			Requests:     []string{dev.Request},
			PoolName:     dev.Pool,
			DeviceName:   dev.Device,
			CDIDeviceIDs: []string{d.name + "/" + cdiClass + "=" + d.cdiName(uid, dev)},
		}
		if dev.ShareID != "" {
			share := types.UID(dev.ShareID)
			device.ShareID = &share
		}
		if attrs, ok := d.attributes[dev.Device]; ok {
			device.Metadata = &kubeletplugin.DeviceMetadata{Attributes: attrs}
		}
		out = append(out, device)
	}
	return out
}

func (d *driver) UnprepareResourceClaims(ctx context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	out := make(map[types.UID]error, len(claims))
	for _, claim := range claims {
		out[claim.UID] = d.unprepare(string(claim.UID))
	}
	return out, nil
}

// unprepare removes the claim's CDI spec, then the claim from the checkpoint; a claim the
// checkpoint does not hold is already unprepared.
func (d *driver) unprepare(uid string) error {
	state, err := d.checkpoint.load()
	if err != nil {
		return err
	}
	if _, ok := state.Claims[uid]; !ok {
		return nil
	}
	if err := removeDurably(d.specPath(uid)); err != nil {
		return err
	}
	delete(state.Claims, uid)
	return d.checkpoint.store(state)
}

func (d *driver) HandleError(ctx context.Context, err error, msg string) {
	fmt.Fprintf(os.Stderr, "peer driver: %s: %v\n", msg, err)
}

func (d *driver) WatchHealthStatus(ctx context.Context, reports chan<- kubeletplugin.DeviceHealthReport) error {
	return kubeletplugin.ErrHealthNotSupported
}
